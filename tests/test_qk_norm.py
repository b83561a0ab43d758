"""QK-norm, checked (harness/features/qk_norm.py, issue 70).

The oracle's norm is held against torch's own ``F.rms_norm``, and the oracle (nn.MHA fed the
normed, then rotated, float64 projections) against softmax attention written here; the
hand-written ways match it under every kernel at prefill, backward and decode, before rotary; a
point it cannot mean is refused in one line; transformers' real Qwen3Attention passes with its
own q_norm and k_norm, and with its norm planted wrong is named."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from harness import verify
from harness.factory import make_point
from harness.features.qk_norm import qk_norm, rms
from harness.features.rotary import rotary
from harness.validate import InvalidPoint
from harness.way.transformed import Transformed

SHAPE = dict(batch=2, embed_dim=32, num_heads=4, device="cpu")
QWEN3 = "examples.hf_qwen3.Qwen3MHA"


@pytest.mark.parametrize("over", ["head", "whole"])
def test_the_oracles_norm_is_torchs_rms_norm(over):
    B, H, T, D = 2, 4, 5, 8
    x = torch.randn(B, H, T, D, dtype=torch.float64) * 3
    if over == "head":
        w = torch.rand(D, dtype=torch.float64) + 0.5
        want = F.rms_norm(x, (D,), w, eps=1e-6)
    else:
        w = torch.rand(H * D, dtype=torch.float64) + 0.5
        flat = x.transpose(1, 2).reshape(B, T, H * D)
        want = F.rms_norm(flat, (H * D,), w, eps=1e-6).view(B, T, H, D).transpose(1, 2)
    torch.testing.assert_close(rms(x, w, 1e-6, over), want, rtol=1e-12, atol=1e-12)


def test_the_oracle_is_nn_mha_fed_the_normed_then_rotated_projections():
    torch.manual_seed(0)
    E, H, B, L = 32, 4, 2, 6
    D = E // H
    mha = torch.nn.MultiheadAttention(E, H, batch_first=True).double()
    spec = dict(layout="half", theta=10000.0, fraction=1.0, scaling="none", factor=1.0,
                original=4096)  # fmt: skip
    oracle = Transformed(E, H, steps=(qk_norm, rotary), rotary=spec,
                         qk_norm=dict(over="head", eps=1e-6)).double()  # fmt: skip
    oracle.q_norm = torch.nn.Parameter(torch.rand(D, dtype=torch.float64) + 0.5)
    oracle.k_norm = torch.nn.Parameter(torch.rand(D, dtype=torch.float64) + 0.5)
    oracle.load_state_dict({**mha.state_dict(), "q_norm": oracle.q_norm, "k_norm": oracle.k_norm})
    x = torch.randn(B, L, E, dtype=torch.float64)
    got = oracle(x, x, x, need_weights=False)[0]
    wq, wk, wv = mha.in_proj_weight.chunk(3)
    bq, bk, bv = mha.in_proj_bias.chunk(3)

    def heads(t):  # (B, L, E) -> (B, H, L, D)
        return t.view(B, L, H, D).transpose(1, 2)

    def rotate(t):  # Llama's rotate_half, written out
        freq = 1.0 / 10000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
        angle = torch.arange(L, dtype=torch.float64).view(-1, 1) * freq  # (L, D/2)
        cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
        return t * cos + torch.cat([-t[..., D // 2 :], t[..., : D // 2]], -1) * sin

    q = rotate(F.rms_norm(heads(x @ wq.T + bq), (D,), oracle.q_norm.detach(), eps=1e-6))
    k = rotate(F.rms_norm(heads(x @ wk.T + bk), (D,), oracle.k_norm.detach(), eps=1e-6))
    out = (q @ k.transpose(-1, -2) / D**0.5).softmax(-1) @ heads(x @ wv.T + bv)
    want = mha.out_proj(out.transpose(1, 2).reshape(B, L, E))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


POINTS = {
    "prefill backward": dict(qk_norm="head", seq_len=8, mask="causal", mode="fwd_bwd"),
    "decode whole rotary": dict(qk_norm="whole", rotary="half", seq_len=2, kv_cache_len=9),
    "grouped bf16 rotary": dict(qk_norm="head", rotary="interleaved", seq_len=8, mask="causal",
                                dtype="bfloat16", num_kv_heads=2),  # fmt: skip
}


@pytest.mark.parametrize("attention", ["manual", "sdpa", "flex"])
@pytest.mark.parametrize("case", list(POINTS))
@pytest.mark.parametrize("way", ["fused", "separate", "packed"])
def test_the_hand_written_ways_match_at_qk_norm_points(way, case, attention):
    row = verify(way, **SHAPE, **POINTS[case], variant={"attention": attention})
    if row["status"] == "unsupported":  # FlexAttention's backward on a CPU, say
        assert "qk_norm" not in row["error"], row["error"]
        pytest.skip(row["error"])
    assert row["status"] == "ok", (row["status"], row["error"], row["diagnosis"])
    assert row["qk_norm"] == POINTS[case]["qk_norm"]
    # the norm bounds the logits: the activation-scale pass says it does not apply, and why
    assert row["act_check"].startswith("not run: QK-norm bounds the logits"), row["act_check"]


def test_the_norms_weights_get_their_gradients_compared(monkeypatch):
    import variants._core as core

    normed = core.normed
    monkeypatch.setattr(core, "normed", lambda x, w, eps, over: normed(x, w.detach(), eps, over))
    row = verify("fused", **SHAPE, **POINTS["prefill backward"])
    assert row["status"] == "mismatch", row
    assert set(row["failed_tensors"].split(";")) == {"grad_q_norm", "grad_k_norm"}, row


@pytest.mark.parametrize(
    "fields, words",
    [
        (dict(qk_norm_eps=1e-5), "qk_norm_eps=1e-05 applies with qk_norm=head|whole"),
        (dict(qk_norm="whole", num_kv_heads=2), "qk_norm=whole with num_kv_heads=2"),
        (dict(qk_norm="head", qk_norm_eps=0.0), "qk_norm_eps"),
        (dict(qk_norm="rows"), "qk_norm"),
    ],
)
def test_what_a_point_cannot_mean_is_refused_in_one_line(fields, words):
    with pytest.raises((InvalidPoint, ValueError)) as raised:
        make_point("fused", **SHAPE, seq_len=8, **fields)
    assert words in str(raised.value) and "\n" not in str(raised.value), str(raised.value)


def test_a_module_without_qk_norm_is_unsupported_not_wrong():
    class Plain(torch.nn.MultiheadAttention):
        def __init__(self, embed_dim, num_heads, bias=True):
            super().__init__(embed_dim, num_heads, bias=bias, batch_first=True)

    sys.modules[__name__].Plain = Plain
    row = verify(f"{__name__}.Plain", **SHAPE, seq_len=8, qk_norm="head")
    assert row["status"] == "unsupported" and "qk_norm" in row["error"], row


def transformers():
    pytest.importorskip(
        "transformers.models.qwen3",
        reason="transformers (with Qwen3) is not installed here: bash "
        "scripts/install-beside-torch.sh transformers (CI installs it)",
    )


QWEN3_SHAPE = dict(batch=2, embed_dim=64, num_heads=8, num_kv_heads=2, device="cpu")
QWEN3_CASES = {
    "backward": dict(seq_len=8, mask="causal", mode="fwd_bwd"),
    "decode concat": dict(seq_len=2, kv_cache_len=9, kv_cache="concat"),
    "decode static padding bf16": dict(seq_len=1, kv_cache_len=9, kv_cache="static",
                                       mask="padding", dtype="bfloat16"),  # fmt: skip
}


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("case", list(QWEN3_CASES))
def test_qwen3s_own_qk_norm_and_rotation_match_the_oracle(case, impl):
    transformers()
    row = verify(QWEN3, **QWEN3_SHAPE, **QWEN3_CASES[case], qk_norm="head", rotary="half",
                 rotary_theta=1000000.0, variant={"attn_implementation": impl})  # fmt: skip
    assert row["status"] == "ok", (row["status"], row["error"], row["diagnosis"])
    assert "transformers" in row["variant_distribution"]


def test_qwen3_is_unsupported_without_qk_norm_saying_why():
    transformers()
    row = verify(QWEN3, **QWEN3_SHAPE, seq_len=8)
    assert row["status"] == "unsupported" and "qk_norm=head" in row["error"], row


def _gemma_norm(self, x):
    """Qwen3RMSNorm with Gemma's weight, (1 + w): the bug of a port between the two."""
    y = x.float()
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return ((1.0 + self.weight.float()) * y).to(x.dtype)


def test_qwen3_with_gemmas_norm_weight_is_named(monkeypatch):
    transformers()
    from transformers.models.qwen3 import modeling_qwen3

    monkeypatch.setattr(modeling_qwen3.Qwen3RMSNorm, "forward", _gemma_norm)
    row = verify(QWEN3, **QWEN3_SHAPE, seq_len=8, mask="causal", qk_norm="head", rotary="half")
    assert row["status"] == "mismatch", row
    assert row["diagnosis"].startswith("qk_norm_weight_offset"), row["diagnosis"]


def test_qwen3_with_k_norm_loaded_from_q_norm_is_named():
    transformers()
    from examples.hf_qwen3 import Qwen3MHA

    class SharedNorm(Qwen3MHA):
        def map_weights(self, state_dict, prefix):
            super().map_weights(state_dict, prefix)
            state_dict[prefix + "attn.k_norm.weight"] = state_dict[prefix + "attn.q_norm.weight"]

    sys.modules[__name__].SharedNorm = SharedNorm
    row = verify(f"{__name__}.SharedNorm", **QWEN3_SHAPE, seq_len=8, mask="causal",
                 qk_norm="head", rotary="half")  # fmt: skip
    assert row["status"] == "mismatch", row
    assert row["diagnosis"].startswith("qk_norm_shared_weight"), row["diagnosis"]
