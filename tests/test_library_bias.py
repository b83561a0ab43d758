"""A library's attention sinks and ALiBi behind the variant contract (variants/library_bias.py):
``sinks_state`` under any name, shape and head order, ``LibraryAlibi`` (the library's own bias
where the class takes ``position_bias``, zeros where the harness hands it in the mask), on a
plain-PyTorch module; then transformers' BloomAttention (examples/hf_bloom.py) and
FalconAttention, whose ALiBi is scaled with the logits, a named mistake (harness/features/alibi.py).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from harness import verify
from variants.adapters import DecoderAttention, KVCache, LibraryAlibi

SHAPE = dict(embed_dim=32, num_heads=4, batch=2, seq_len=8)


def key_only_alibi(B: int, S: int, H: int, dtype, device) -> torch.Tensor:
    """BLOOM's bias, written here: +slope_h * j for key j, (B*H, 1, S)."""
    slopes = torch.tensor([2 ** (-8 * (h + 1) / H) for h in range(H)], device=device)
    return (slopes.view(1, H, 1) * torch.arange(S, device=device)).expand(B, H, S).reshape(
        B * H, 1, S
    ).to(dtype)


class SinkAttention(nn.Module):
    """A plain-PyTorch library's attention: separate q/k/v/o projections, grouped K/V heads, its
    sinks as ``learned_sink`` of (Hkv, G) (head h = kv * G + g), and ALiBi as a (B*H, 1, S) tensor
    argument, forward(x, bias, attention_mask) -> (out, None)."""

    def __init__(self, E: int, H: int, Hkv: int, sinks: bool, reverse: bool = False):
        super().__init__()
        self.reverse = reverse  # its sinks kept in the reverse order of its heads
        self.H, self.Hkv, self.D = H, Hkv, E // H
        self.q_proj, self.o_proj = nn.Linear(E, E), nn.Linear(E, E)
        self.k_proj, self.v_proj = nn.Linear(E, Hkv * self.D), nn.Linear(E, Hkv * self.D)
        self.learned_sink = nn.Parameter(torch.zeros(Hkv, H // Hkv)) if sinks else None

    def forward(self, x, bias, attention_mask):
        B, L, E = x.shape
        q = self.q_proj(x).view(B, L, self.H, self.D).transpose(1, 2)  # (B, H, L, D)
        kv = (p(x).view(B, L, self.Hkv, self.D).transpose(1, 2) for p in (self.k_proj, self.v_proj))
        k, v = kv
        k, v = (t.repeat_interleave(self.H // self.Hkv, dim=1) for t in (k, v))
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.D) + attention_mask  # (B, H, L, S)
        scores = scores + bias.view(B, self.H, 1, -1)
        if self.learned_sink is not None:
            sink = self.learned_sink.reshape(self.H)
            sink = (sink.flip(0) if self.reverse else sink).view(1, self.H, 1, 1)
            sink = sink.expand(B, self.H, L, 1)
            scores = torch.cat([scores, sink.to(scores.dtype)], dim=-1)
        weights = scores.softmax(dim=-1)[..., : k.size(2)]
        return self.o_proj((weights @ v).transpose(1, 2).reshape(B, L, E)), None


class SinkMHA(DecoderAttention):
    """``SinkAttention`` behind the contract: applies its own (key-only) ALiBi when its class is
    handed ``position_bias``; ``name`` and ``heads`` planted wrong by the tests."""

    def __init__(self, embed_dim, num_heads, bias=True, num_kv_heads=None, sinks=False,
                 position_bias="none", name="learned_sink", heads=None,
                 reverse=False):  # fmt: skip
        Hkv = num_kv_heads or num_heads
        attn = SinkAttention(embed_dim, num_heads, Hkv, sinks, reverse)
        super().__init__(attn, None, num_heads=num_heads, num_kv_heads=Hkv,
                         head_dim=embed_dim // num_heads, rotary=None, sinks=name,
                         sink_heads=heads)  # fmt: skip
        build = lambda B, S, dtype, device: key_only_alibi(B, S, num_heads, dtype, device)  # noqa: E731
        self.alibi = LibraryAlibi(build, position_bias)

    def call(self, x, mask, kwargs, kv_cache: KVCache | None):
        return self.attn(x, self.alibi(x.size(0), mask.size(-1), x.dtype, x.device), mask)


class HarnessAlibiMHA(SinkMHA):
    """The same module whose class takes no ``position_bias``: nn.MHA's bias is in its mask, and
    ``LibraryAlibi`` hands the library zeros."""

    def __init__(self, embed_dim, num_heads, bias=True, num_kv_heads=None, sinks=False):
        super().__init__(embed_dim, num_heads, bias, num_kv_heads, sinks)


SINKS = f"{__name__}.SinkMHA"


@pytest.mark.parametrize("mode", ["fwd", "fwd_bwd"])
def test_sinks_under_another_name_and_shape_are_loaded_and_their_gradient_checked(mode):
    row = verify(SINKS, **SHAPE, num_kv_heads=2, sinks=True, mask="causal", mode=mode)
    assert row["status"] == "ok", (row["error"], row["diagnosis"])


def test_sinks_in_another_head_order_need_their_order():
    """A module that keeps its sinks in the reverse order of its heads passes when the adapter
    says so (``sink_heads``), and is a mismatch, its heads located, when it does not."""
    told = dict(reverse=True, heads=list(range(SHAPE["num_heads"]))[::-1])
    row = verify(SINKS, **SHAPE, sinks=True, mask="causal", mode="fwd_bwd", variant=told)
    assert row["status"] == "ok", (row["error"], row["diagnosis"])
    row = verify(SINKS, **SHAPE, sinks=True, mask="causal", variant={"reverse": True})
    assert row["status"] == "mismatch" and "heads" in row["error"], row["error"]


def test_sinks_under_a_name_the_module_lacks_are_one_line_naming_its_parameters():
    row = verify(SINKS, **SHAPE, sinks=True, mask="causal", variant={"name": "sinks"})
    assert row["status"] != "ok"
    assert "no parameter 'sinks'" in row["error"] and "learned_sink" in row["error"], row
    assert "pass sinks=" in row["error"] and "\n" not in row["error"].strip()


@pytest.mark.parametrize("target", [SINKS, f"{__name__}.HarnessAlibiMHA"])
@pytest.mark.parametrize("mode", ["fwd", "fwd_bwd"])
def test_alibi_the_library_applies_or_the_harness_hands_passes_under_a_causal_mask(target, mode):
    row = verify(target, **SHAPE, position_bias="alibi", mask="causal", mode=mode)
    assert row["status"] == "ok", (row["error"], row["diagnosis"])


def test_library_alibi_is_the_librarys_bias_or_zeros_made_once():
    calls = []

    def build(B, S, dtype, device):
        calls.append((B, S))
        return key_only_alibi(B, S, 4, dtype, device)

    own, given = LibraryAlibi(build, "alibi"), LibraryAlibi(build, "none")
    a = own(2, 8, torch.float32, "cpu")
    assert own(2, 8, torch.float32, "cpu") is a and a.abs().sum() > 0 and a.shape == (8, 1, 8)
    assert given(2, 8, torch.float32, "cpu").eq(0).all()
    assert calls == [(2, 8), (2, 8)]  # once per adapter and shape


def test_the_key_position_shortcut_is_named_with_sinks_under_a_causal_mask():
    """BLOOM's shortcut is right under a causal mask alone (the row's -slope * i cancels), but
    not with sinks: the sink's column gets no -slope * i. The diagnosis tries it there."""
    row = verify(SINKS, **SHAPE, sinks=True, position_bias="alibi", mask="causal")
    assert row["status"] == "mismatch"
    assert row["diagnosis"] == "alibi_key_position_only", (row["diagnosis"], row["error"])


def transformers(module: str):
    return pytest.importorskip(
        module,
        reason="transformers is not installed here: bash scripts/install-beside-torch.sh "
        "transformers (CI installs it)",
    )


BLOOM = "examples.hf_bloom.BloomMHA"
BLOOM_CASES = {
    "prefill": dict(mask="causal"),
    "backward": dict(mask="causal", mode="fwd_bwd"),
    "window": dict(mask="sliding", window=3),
    "decode static": dict(seq_len=1, kv_cache_len=8, kv_cache="static"),
    "decode concat": dict(seq_len=3, kv_cache_len=8, kv_cache="concat", mask="causal"),
    "bfloat16": dict(mask="causal", dtype="bfloat16"),
}


@pytest.mark.parametrize("alibi", ["none", "alibi"])
@pytest.mark.parametrize("case", list(BLOOM_CASES))
def test_bloom_with_its_own_alibi_matches_nn_mha(case, alibi):
    transformers("transformers.models.bloom")
    row = verify(BLOOM, **{**SHAPE, **BLOOM_CASES[case]}, position_bias=alibi)
    assert row["status"] == "ok", (row["error"], row["diagnosis"])
    assert "transformers" in row["variant_distribution"]


def test_bloom_without_a_causal_mask_is_named_its_shortcut():
    transformers("transformers.models.bloom")
    row = verify(BLOOM, **SHAPE, mask="none", position_bias="alibi")
    assert (row["status"], row["diagnosis"]) == ("mismatch", "alibi_key_position_only"), row


class FalconMHA(DecoderAttention):
    """transformers' FalconAttention with ALiBi (eager): it adds the bias to q.k before the
    1/sqrt(head_dim) scale."""

    _fixed_ = {"bias": True}

    def __init__(self, embed_dim, num_heads, bias=True, position_bias="none"):
        from variants.adapters import library, library_attention

        falcon = "transformers.models.falcon.modeling_falcon"
        attn, config = library_attention(
            falcon, "Falcon", hidden_size=embed_dim, num_attention_heads=num_heads, alibi=True,
            bias=True, new_decoder_architecture=False, multi_query=False,
            attn_implementation="eager",
        )  # fmt: skip
        layout = dict(qkv="query_key_value", out="dense", order="heads")
        super().__init__(attn, config, num_kv_heads=num_heads, layout=layout,
                         cache="layer_past", rotary=None)  # fmt: skip
        (alibi,) = library(falcon, "build_alibi_tensor")
        self.alibi = LibraryAlibi(
            lambda B, S, dtype, d: alibi(torch.ones(B, S, device=d), num_heads, dtype),
            position_bias,
        )

    def call(self, x, mask, kwargs, kv_cache):
        alibi = self.alibi(x.size(0), mask.size(-1), x.dtype, x.device)
        return tuple(self.attn(x, alibi, mask, layer_past=kwargs.get("layer_past"))[:2])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    "case", [dict(seq_len=16, mask="causal"), dict(seq_len=1, kv_cache_len=32, kv_cache="concat")]
)
def test_falcons_scaled_alibi_is_named_not_taken_for_a_missing_one(case, dtype):
    transformers("transformers.models.falcon")
    shape = {**SHAPE, "num_heads": 8, "embed_dim": 64, **case}
    row = verify(f"{__name__}.FalconMHA", **shape, position_bias="alibi", dtype=dtype)
    assert (row["status"], row["diagnosis"]) == ("mismatch", "alibi_scaled_with_logits"), row
