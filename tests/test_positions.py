"""ALiBi (issue 59): nn.MultiheadAttention handed the bias in its float attn_mask is the oracle,
tested here against a direct float64 implementation; the hand-written ways apply it themselves
(variants/positions.py, each kernel), and modules that get it wrong fail their check."""

import math

import pytest
import torch
import torch.nn as nn

from harness.api import verify
from harness.config import InvalidPoint
from harness.factory import make_point
from harness.features import alibi as positions
from harness.way import capabilities
from harness.way.calls import handed
from tests.combinations import ACROSS
from tests.direct import projected
from variants import positions as ours
from variants.fused import FusedQKVMHA

SHAPE = dict(batch=2, seq_len=12, embed_dim=48, num_heads=6, num_threads=1)


def _direct(mha: nn.MultiheadAttention, x, H: int, slopes, L: int, S: int, hidden=None):
    """ALiBi attention written out in float64, head by head: softmax(q k^T / sqrt(D) - slope_h
    |i - j| [-inf where hidden]) v, then the output projection. x (B, S, E); the queries are
    the last L of the S positions."""
    B, _, E = x.shape
    D = E // H
    q, k, v = projected(mha, x, H, L)  # (B, L, H, D), (B, S, H, D) x 2
    out = torch.zeros(B, L, H, D, dtype=torch.float64)
    for h in range(H):
        for i in range(L):
            logits = (k[:, :, h] @ q[:, i, h].unsqueeze(-1)).squeeze(-1) / math.sqrt(D)  # (B, S)
            distance = torch.tensor([abs(S - L + i - j) for j in range(S)], dtype=torch.float64)
            logits = logits - slopes[h] * distance
            if hidden is not None:
                logits = logits.masked_fill(hidden[i], -math.inf)
            out[:, i, h] = torch.softmax(logits, dim=-1).unsqueeze(1).bmm(v[:, :, h]).squeeze(1)
    return mha.out_proj(out.reshape(B, L, E))


@pytest.mark.parametrize("H, L, S, causal", [(4, 6, 6, False), (6, 6, 6, True), (12, 3, 10, True)])
def test_nn_mha_handed_the_bias_computes_alibi_exactly(H, L, S, causal):
    torch.manual_seed(0)
    B, E = 2, 4 * H
    mha = nn.MultiheadAttention(E, H, batch_first=True, dtype=torch.float64)
    x = torch.randn(B, S, E, dtype=torch.float64)
    hidden = torch.arange(S).view(1, S) > torch.arange(S - L, S).view(L, 1) if causal else None
    given = {} if hidden is None else {"attn_mask": hidden, "is_causal": True}
    queries, keys = torch.arange(S - L, S), torch.arange(S)
    added = positions.alibi(positions.alibi_slopes(H), queries, keys)  # (H, L, S)
    kwargs = handed(given, added, B, H, L, S, torch.float64, "cpu")
    assert "is_causal" not in kwargs and kwargs["attn_mask"].shape == (B * H, L, S)
    got, _ = mha(x[:, S - L :], x, x, need_weights=False, **kwargs)
    want = _direct(mha, x, H, positions.alibi_slopes(H), L, S, hidden)
    assert torch.allclose(got, want, rtol=0, atol=1e-12), (got - want).abs().max()


def test_the_slopes_are_the_papers_and_both_sides_agree():
    assert positions.alibi_slopes(8) == [2.0**-i for i in range(1, 9)]
    # not a power of two: the 8 of H=8, then every other slope of H=16 (BLOOM's rule)
    assert positions.alibi_slopes(12) == [2.0**-i for i in range(1, 9)] + [
        2.0**-0.5,
        2.0**-1.5,
        2.0**-2.5,
        2.0**-3.5,
    ]
    for H in range(1, 65):
        assert (
            max(abs(a - b) for a, b in zip(ours.alibi_slopes(H), positions.alibi_slopes(H))) < 1e-15
        )


@pytest.mark.parametrize(
    "variant, keys",
    [
        *ACROSS,
        ("reference", dict(mask="causal")),  # nn.MHA handed the bias, in its own dtype
        # FlexAttention's score_mod (a compile of about 15 s): make test-slow and CI
        pytest.param(
            "fused", dict(mask="causal", variant={"attention": "flex"}), marks=pytest.mark.slow
        ),
        ("reference", dict(kv_cache_len=9, seq_len=3, mask="padding")),
    ],
)
def test_the_ways_compute_alibi_as_nn_mha_does(variant, keys):
    row = verify(variant, **{**SHAPE, "position_bias": "alibi", **keys})
    assert row["status"] == "ok", (row["error"], row.get("max_abs_err"), row.get("tolerance"))


class Forgets(FusedQKVMHA):  # takes position_bias, adds none
    def __init__(self, *args, position_bias="none", **kwargs):
        super().__init__(*args, position_bias=position_bias, **kwargs)
        self.slopes = None


class Reversed(FusedQKVMHA):  # the slopes in the other head order
    def __init__(self, *args, position_bias="none", **kwargs):
        super().__init__(*args, position_bias=position_bias, **kwargs)
        self.slopes = tuple(reversed(self.slopes))


class Shared(FusedQKVMHA):  # head 0's slope for every head
    def __init__(self, *args, position_bias="none", **kwargs):
        super().__init__(*args, position_bias=position_bias, **kwargs)
        self.slopes = (self.slopes[0],) * len(self.slopes)


class Sign(FusedQKVMHA):  # +slope * distance
    def __init__(self, *args, position_bias="none", **kwargs):
        super().__init__(*args, position_bias=position_bias, **kwargs)
        self.slopes = tuple(-s for s in self.slopes)


def _own_bias(build):
    """A kernel that adds ``build(H, L, S, device)`` (1, H, L, S) where ALiBi should be: SDPA
    with the point's masks and that bias."""

    def attend(q, k, v, m):
        mask = m._replace(slopes=None).merged(q.dtype, q.device)
        if m.causal:
            causal = torch.ones(m.L, m.S, dtype=torch.bool, device=q.device).triu(1)
            mask = (0 if mask is None else mask) + torch.zeros(m.L, m.S).masked_fill(
                causal, -math.inf
            )
        bias = build(len(m.slopes), m.L, m.S, q.device).to(q.dtype)
        mask = bias if mask is None else mask + bias
        k, v = (t.repeat_interleave(q.size(1) // t.size(1), dim=1) for t in (k, v))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    return attend


class DecodeOffset(FusedQKVMHA):  # a decode step's queries at positions 0 .. L-1
    def __init__(self, *args, position_bias="none", **kwargs):
        super().__init__(*args, position_bias=position_bias, **kwargs)
        slopes = torch.tensor(self.slopes).view(1, -1, 1, 1)

        def build(H, L, S, device):
            i, j = torch.arange(L).view(L, 1), torch.arange(S).view(1, S)
            return -slopes * (i - j).abs()

        self.kernel = self.kernel.__class__(name="own", fn=_own_bias(build), doc="")


class KeyOnly(FusedQKVMHA):  # BLOOM's +slope * j, right only under a causal mask
    def __init__(self, *args, position_bias="none", **kwargs):
        super().__init__(*args, position_bias=position_bias, **kwargs)
        slopes = torch.tensor(self.slopes).view(1, -1, 1, 1)

        def build(H, L, S, device):
            return (slopes * torch.arange(S).view(1, S)).expand(1, H, L, S)

        self.kernel = self.kernel.__class__(name="own", fn=_own_bias(build), doc="")


@pytest.mark.parametrize(
    "wrong, named, keys",
    [
        (Forgets, "alibi_missing", dict(mask="causal")),
        (Reversed, "alibi_slopes_reversed", dict(mask="none")),
        (Shared, "alibi_slope_shared", dict(mask="causal", dtype="bfloat16")),
        (Sign, "alibi_sign", dict(mask="padding", mode="fwd_bwd")),
        (DecodeOffset, "alibi_decode_offset", dict(kv_cache_len=9, seq_len=2)),
        (KeyOnly, "alibi_key_position_only", dict(mask="none", num_kv_heads=2)),
    ],
)
def test_a_module_that_gets_alibi_wrong_fails_its_check_and_the_mistake_is_named(
    wrong, named, keys
):
    row = verify(wrong, **{**SHAPE, "position_bias": "alibi", **keys})
    assert row["status"] == "mismatch", (row["status"], row["error"])
    assert row["diagnosis"].split(";") == [named], row["diagnosis"]


def test_the_shortcut_that_is_right_under_a_causal_mask_is_not_called_wrong_there():
    """BLOOM's +slope * j differs from -slope * |i - j| by a shift common to each query's row,
    which the softmax ignores, wherever the keys after the query are hidden."""
    row = verify(KeyOnly, **SHAPE, position_bias="alibi", mask="causal")
    assert row["status"] == "ok", (row["status"], row["error"])


def test_alibi_refused_where_it_means_nothing_and_unsupported_by_a_kernel_without_it():
    with pytest.raises(InvalidPoint, match=r"^position_bias=alibi with cross=true: "):
        make_point("fused", position_bias="alibi", cross=True)
    with pytest.raises(InvalidPoint, match=r"^position_bias='rope' is not one of none\|alibi"):
        make_point("fused", position_bias="rope")
    point = make_point("fused", variant={"attention": "flash_attn"}, position_bias="alibi")
    refused = capabilities.apply(point).refused
    assert refused is not None and "attention=flash_attn" in refused, refused


class TakesAlibiKeepsNoAttribute(torch.nn.Module):
    """A BLOOM-style adapter (issue 73): its class takes ``position_bias`` and applies ALiBi (in
    the module it wraps), but keeps no attribute of that name itself."""

    def __init__(self, embed_dim, num_heads, bias=True, position_bias="none"):
        super().__init__()
        from variants.fused import FusedQKVMHA

        self.inner = FusedQKVMHA(embed_dim, num_heads, bias=bias, position_bias=position_bias)
        self._register_load_state_dict_pre_hook(self.into_inner)

    def into_inner(self, state_dict, prefix, *args):
        for k in [k for k in state_dict if k.startswith(prefix) and ".inner." not in f".{k}"]:
            state_dict[f"{prefix}inner.{k[len(prefix):]}"] = state_dict.pop(k)

    def forward(self, *args, **kwargs):
        return self.inner(*args, **kwargs)


def test_a_class_that_takes_position_bias_is_not_handed_the_bias_again():
    import sys

    from harness import verify

    sys.modules[__name__].TakesAlibiKeepsNoAttribute = TakesAlibiKeepsNoAttribute
    row = verify(f"{__name__}.TakesAlibiKeepsNoAttribute", batch=2, seq_len=16, embed_dim=32,
                 num_heads=4, mask="causal", position_bias="alibi", device="cpu")  # fmt: skip
    assert row["status"] == "ok", (row["error"], row["diagnosis"])
