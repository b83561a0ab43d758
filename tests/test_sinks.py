"""Attention sinks (issue 59): nn.MultiheadAttention with its zero key (add_zero_attn) and -s_h
on every real key's logit is the oracle, tested here against a direct float64 implementation,
gradient included; the hand-written ways apply the sinks themselves (each kernel), and modules
that get them wrong fail their check with the mistake named."""

import math

import pytest
import torch
import torch.nn as nn

from harness.api import verify
from harness.config import InvalidPoint
from harness.factory import make_point
from harness.features import sinks
from harness.way import capabilities, kernels
from harness.way.calls import handed
from tests.combinations import ACROSS
from tests.direct import projected
from variants.fused import FusedQKVMHA
from variants.kernels import Kernel

SHAPE = dict(batch=2, seq_len=12, embed_dim=48, num_heads=6, num_threads=1, sinks=True)


def _direct(mha: nn.MultiheadAttention, x, H: int, s, L: int, S: int, hidden=None):
    """Sink attention written out in float64, head by head: softmax over [q k^T / sqrt(D)
    (-inf where hidden), s_h], the sink's column dropped, times v; then the output projection.
    x (B, S, E); the queries are the last L of the S positions."""
    B, _, E = x.shape
    D = E // H
    q, k, v = projected(mha, x, H, L)  # (B, L, H, D), (B, S, H, D) x 2
    rows = []
    for h in range(H):
        heads = []
        for i in range(L):
            logits = (k[:, :, h] @ q[:, i, h].unsqueeze(-1)).squeeze(-1) / math.sqrt(D)  # (B, S)
            if hidden is not None:
                logits = logits.masked_fill(hidden[i], -math.inf)
            full = torch.cat([logits, s[h].expand(B, 1)], dim=-1)  # (B, S + 1)
            p = torch.softmax(full, dim=-1)[:, :S]
            heads.append(p.unsqueeze(1).bmm(v[:, :, h]).squeeze(1))  # (B, D)
        rows.append(torch.stack(heads, dim=1))  # (B, L, D)
    out = torch.stack(rows, dim=2)  # (B, L, H, D)
    return mha.out_proj(out.reshape(B, L, E))


@pytest.mark.parametrize("H, L, S, causal", [(4, 6, 6, False), (6, 6, 6, True), (3, 2, 9, True)])
def test_nn_mha_with_a_zero_key_and_the_sinks_in_its_mask_computes_sinks_exactly(H, L, S, causal):
    torch.manual_seed(0)
    B, E = 2, 4 * H
    mha = nn.MultiheadAttention(E, H, batch_first=True, dtype=torch.float64, add_zero_attn=True)
    values = sinks.logits(H, S, torch.Generator().manual_seed(1))
    mha.register_parameter("sinks", torch.nn.Parameter(values.to(mha.in_proj_weight.dtype)))
    x = torch.randn(B, S, E, dtype=torch.float64)
    hidden = torch.arange(S).view(1, S) > torch.arange(S - L, S).view(L, 1) if causal else None
    given = {} if hidden is None else {"attn_mask": hidden, "is_causal": True}
    kwargs = handed(given, -mha.sinks.view(-1, 1, 1), B, H, L, S, torch.float64, "cpu")
    got, _ = mha(x[:, S - L :], x, x, need_weights=False, **kwargs)
    want = _direct(mha, x, H, mha.sinks, L, S, hidden)
    assert torch.allclose(got, want, rtol=0, atol=1e-12), (got - want).abs().max()
    # the sinks' gradient reaches nn.MHA's parameter through the mask, as the direct one's
    g = torch.randn_like(got)
    (mine,) = torch.autograd.grad(got, mha.sinks, g)
    (theirs,) = torch.autograd.grad(want, mha.sinks, g)
    assert mine.abs().max() > 1e-3 and torch.allclose(mine, theirs, rtol=0, atol=1e-12)


def test_the_sinks_weigh_as_much_as_the_keys_so_that_a_mistake_shows():
    s = sinks.logits(8, 1024, torch.Generator().manual_seed(0))
    assert s.shape == (8,) and s.max() > math.log(1024) and s.min() < -0.25 * math.log(1024)
    assert len(set(s.tolist())) == 8  # one per head
    assert torch.equal(s, sinks.logits(8, 1024, torch.Generator().manual_seed(0)))


@pytest.mark.parametrize(
    "variant, keys",
    [
        *ACROSS,
        ("fused", dict(mask="documents", documents=3, position_bias="alibi", mode="fwd_bwd")),
        ("reference", dict(mask="padding", mode="fwd_bwd", need_weights=True)),
        ("reference", dict(kv_cache_len=9, seq_len=3, position_bias="alibi")),
        ("fused", dict(cross=True, kv_seq_len=7)),
        # FlexAttention (its zero key in the padding) and compile=default: compiles of 10-30 s
        pytest.param(
            "fused",
            dict(
                mask="padding", num_kv_heads=2, position_bias="alibi", variant={"attention": "flex"}
            ),
            marks=pytest.mark.slow,
        ),
        pytest.param("fused", dict(mask="causal", compile="default"), marks=pytest.mark.slow),
    ],
)
def test_the_ways_compute_sinks_as_nn_mha_does(variant, keys):
    row = verify(variant, **{**SHAPE, **keys})
    assert row["status"] == "ok", (row["error"], row.get("max_abs_err"), row.get("tolerance"))


def _own(column_of):
    """A kernel: manual attention whose sink column is ``column_of(masks, scores)``."""

    def attend(q, k, v, m):
        k, v = (t.repeat_interleave(q.size(1) // t.size(1), dim=1) for t in (k, v))
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.size(-1))  # (B, H, L, S)
        if m.causal:
            hidden = torch.ones(m.L, m.S, dtype=torch.bool, device=q.device).triu(1)
            scores = scores.masked_fill(hidden, -math.inf)
        mask = m._replace(sinks=None).merged(q.dtype, q.device)
        scores = scores if mask is None else scores + mask
        column = column_of(m, scores).to(scores.dtype).expand(*scores.shape[:3], 1)
        return torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1] @ v

    return Kernel(name="own", fn=attend, doc="")


class OwnSink(FusedQKVMHA):  # its kernel appends ``column(masks, scores)`` as the sink
    @staticmethod
    def column(m, scores):
        return m.sinks.view(1, -1, 1, 1)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.kernel = _own(self.column)


class Shared(OwnSink):  # head 0's sink for every head
    column = staticmethod(lambda m, s: m.sinks.view(1, -1, 1, 1)[:, :1])


class AfterMax(OwnSink):  # exp(s_h), not exp(s_h - max): the sink's logit is s_h + max
    column = staticmethod(lambda m, s: m.sinks.view(1, -1, 1, 1) + s.amax(-1, keepdim=True))


class Sign(OwnSink):
    column = staticmethod(lambda m, s: -m.sinks.view(1, -1, 1, 1))


class Scaled(OwnSink):  # head_dim 8 at SHAPE
    column = staticmethod(lambda m, s: m.sinks.view(1, -1, 1, 1) / math.sqrt(8))


class Detached(OwnSink):
    column = staticmethod(lambda m, s: m.sinks.view(1, -1, 1, 1).detach())


class Forgets(FusedQKVMHA):  # takes sinks, holds them, applies none
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        inner = self.kernel.fn
        self.kernel = Kernel(
            name="own", fn=lambda q, k, v, m: inner(q, k, v, m._replace(sinks=None)), doc=""
        )


@pytest.mark.parametrize(
    "wrong, named, keys",
    [
        (Forgets, "sinks_missing", dict(mask="causal")),
        (Shared, "sinks_shared", dict(mode="fwd_bwd")),
        (AfterMax, "sinks_after_max", {}),
        (Sign, "sinks_sign", dict(mask="padding")),
        (Scaled, "sinks_scaled", dict(num_kv_heads=2)),
        (Detached, "sinks_detached", dict(mode="fwd_bwd")),
    ],
)
def test_a_module_that_gets_sinks_wrong_fails_its_check_and_the_mistake_is_named(
    wrong, named, keys
):
    row = verify(wrong, **{**SHAPE, **keys})
    assert row["status"] == "mismatch", (row["status"], row["error"])
    assert row["diagnosis"].split(";") == [named], row["diagnosis"]


class NoSinks(nn.Module):  # a drop-in whose class takes no sinks
    def __init__(self, embed_dim, num_heads, bias=True):
        super().__init__()
        self.mha = nn.MultiheadAttention(embed_dim, num_heads, bias=bias, batch_first=True)

    def forward(self, *args, **kwargs):
        return self.mha(*args, **kwargs)


def test_sinks_refused_in_one_line_and_unsupported_where_a_module_or_kernel_has_none():
    with pytest.raises(InvalidPoint, match=r"^sinks='yes' must be true or false$"):
        make_point("fused", sinks="yes")
    point = make_point("fused", variant={"attention": "flash_attn"}, sinks=True)
    declared = kernels.get("flash_attn").supports()  # whether or not flash-attn imports here
    refused = capabilities._refusal(point, {"sinks": declared["sinks"]}, "attention=x")
    assert refused is not None and refused.startswith(
        "sinks=true: attention=x declares sinks=false"
    )

    row = verify(NoSinks, **SHAPE)
    assert row["status"] == "unsupported" and "takes no sinks" in row["error"], row["error"]
