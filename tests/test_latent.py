"""Multi-head latent attention (harness/features/latent.py, variants/latent.py): the oracle held
against MLA written from DeepSeek's formulas and against transformers' DeepseekV3Attention, the
two forms of the hand-written module checked at the feature's points, its refusals in one line,
and mistakes written into a module (not the catalogue's steps) named."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from harness.api import verify
from harness.config import InvalidPoint
from harness.factory import make_point
from harness.way.inputs import make_reference
from variants.latent import LatentAttention

H, NOPE, ROPE, DV, R, QR = 4, 6, 4, 8, 8, 12  # D = 10, E = 40: DeepSeek's shape, shrunk
D, E = NOPE + ROPE, H * (NOPE + ROPE)
SMALL = dict(batch=2, seq_len=6, embed_dim=24, num_heads=4, device="cpu", bias=False)


def deepseek_weights(gen) -> dict:
    """DeepSeek-V3's attention weights (its names and layouts: per head [nope; rope] rows)."""

    def w(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64) * shape[-1] ** -0.5

    return dict(
        q_a_proj=w(QR, E), q_a_layernorm=torch.rand(QR, generator=gen, dtype=torch.float64) + 0.5,
        q_b_proj=w(H * D, QR), kv_a_proj_with_mqa=w(R + ROPE, E),
        kv_a_layernorm=torch.rand(R, generator=gen, dtype=torch.float64) + 0.5,
        kv_b_proj=w(H * (NOPE + DV), R), o_proj=w(E, H * DV),
    )  # fmt: skip


def oracle_state(ds: dict) -> dict:
    """The same model in the oracle's names and layouts (harness/features/latent.py)."""
    q_b = ds["q_b_proj"].view(H, D, QR)
    kv_b = ds["kv_b_proj"].view(H, NOPE + DV, R)
    out = torch.zeros(E, H, D, dtype=torch.float64)
    out[:, :, :DV] = ds["o_proj"].view(E, H, DV)
    return {
        "in_proj_weight": torch.zeros(3 * E, E, dtype=torch.float64),
        "out_proj.weight": out.reshape(E, E),
        "q_down": ds["q_a_proj"], "q_down_norm": ds["q_a_layernorm"],
        "q_up": torch.cat([q_b[:, NOPE:], q_b[:, :NOPE]], dim=1).reshape(H * D, QR),
        "kv_down": ds["kv_a_proj_with_mqa"][:R], "kv_down_norm": ds["kv_a_layernorm"],
        "k_rope": ds["kv_a_proj_with_mqa"][R:],
        "k_up": kv_b[:, :NOPE].reshape(H * NOPE, R), "v_up": kv_b[:, NOPE:].reshape(H * DV, R),
    }  # fmt: skip


def point(**keys):
    return make_point(
        "reference", batch=2, seq_len=7, embed_dim=E, num_heads=H, kv_lora_rank=R, q_lora_rank=QR,
        latent_rope_dim=ROPE, latent_v_dim=DV, bias=False, rotary="interleaved",
        rotary_theta=100.0, mask="causal", device="cpu", **keys,
    )  # fmt: skip


def oracle_out(p, ds: dict, x: torch.Tensor) -> torch.Tensor:
    oracle = make_reference(p)
    oracle.load_state_dict(oracle_state(ds))
    L = x.size(1)
    causal = torch.ones(L, L, dtype=torch.bool).triu(1)
    return oracle(x, x, x, attn_mask=causal, need_weights=False)[0]


def rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def mla_from_formulas(ds: dict, x: torch.Tensor, theta: float) -> torch.Tensor:
    """MLA as DeepSeek-V2's paper writes it (eqs. 37-47), its rotation in complex numbers (the
    reference code's ``torch.polar``, pairs 2i, 2i + 1), the softmax written out: nothing of the
    harness."""
    B, L, _ = x.shape
    pos = torch.arange(L, dtype=torch.float64)
    freq = 1.0 / theta ** (torch.arange(0, ROPE, 2, dtype=torch.float64) / ROPE)
    turn = torch.polar(torch.ones(L, ROPE // 2, dtype=torch.float64), pos[:, None] * freq)

    def rotate(t):  # (..., L, ROPE)
        z = torch.view_as_complex(t.reshape(*t.shape[:-1], ROPE // 2, 2).contiguous())
        return torch.view_as_real(z * turn).flatten(-2)

    c_q = rms(x @ ds["q_a_proj"].T, ds["q_a_layernorm"])
    q = (c_q @ ds["q_b_proj"].T).view(B, L, H, D).transpose(1, 2)  # (B, H, L, D)
    q_nope, q_pe = q[..., :NOPE], rotate(q[..., NOPE:])
    kv = x @ ds["kv_a_proj_with_mqa"].T
    c_kv, k_pe = rms(kv[..., :R], ds["kv_a_layernorm"]), rotate(kv[..., R:])[:, None]  # shared
    kv_b = (c_kv @ ds["kv_b_proj"].T).view(B, L, H, NOPE + DV).transpose(1, 2)
    k_nope, v = kv_b[..., :NOPE], kv_b[..., NOPE:]
    scores = (q_nope @ k_nope.transpose(-1, -2) + q_pe @ k_pe.transpose(-1, -2)) / D**0.5
    scores = scores.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
    o = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, L, H * DV)
    return o @ ds["o_proj"].T


def test_the_oracle_is_mla_as_its_paper_writes_it():
    gen = torch.Generator().manual_seed(0)
    ds, x = deepseek_weights(gen), torch.randn(2, 7, E, generator=gen, dtype=torch.float64)
    got = oracle_out(point(), ds, x)
    assert torch.allclose(got, mla_from_formulas(ds, x, theta=100.0), atol=1e-12, rtol=0)


def test_the_oracle_equals_transformers_deepseek_v3_attention():
    transformers()
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3Attention,
        DeepseekV3RotaryEmbedding,
    )

    config = DeepseekV3Config(
        hidden_size=E, num_attention_heads=H, num_key_value_heads=H, q_lora_rank=QR,
        kv_lora_rank=R, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=DV,
        rope_interleave=True, rope_parameters={"rope_type": "default", "rope_theta": 100.0},
    )  # fmt: skip
    config._attn_implementation = "eager"
    attn = DeepseekV3Attention(config, layer_idx=0).double().eval()
    gen = torch.Generator().manual_seed(1)
    ds = deepseek_weights(gen)
    with torch.no_grad():
        for name, t in ds.items():
            module = getattr(attn, name)
            module.weight.copy_(t)
    x = torch.randn(2, 7, E, generator=gen, dtype=torch.float64)
    # its rotary embedding's own angles, made in float64 (it makes them in float32: 2.5e-7 off)
    made = 1.0 / 100.0 ** (torch.arange(0, ROPE, 2).double() / ROPE)
    assert torch.allclose(DeepseekV3RotaryEmbedding(config).inv_freq.double(), made, rtol=1e-6)
    angles = torch.arange(7, dtype=torch.float64)[:, None] * made
    angles = torch.cat([angles, angles], dim=-1)[None]  # (1, L, ROPE), as it hands them
    cos, sin = angles.cos(), angles.sin()
    mask = torch.zeros(7, 7, dtype=torch.float64).masked_fill(
        torch.ones(7, 7, dtype=torch.bool).triu(1), float("-inf")
    )[None, None]
    want = attn(x, (cos, sin), mask)[0]
    # its RMSNorms compute in float32 whatever the input (2.5e-7 here); the paper's formulas
    # above hold the oracle to 1e-12
    assert torch.allclose(oracle_out(point(), ds, x), want, atol=2e-6, rtol=0)


FORMS = [{}, {"form": "absorbed"}, {"form": "absorbed", "attention": "manual"}]
POINTS = [
    dict(kv_lora_rank=4, mask="causal", mode="fwd_bwd"),
    dict(kv_lora_rank=4, q_lora_rank=6, latent_v_dim=3, mask="padding", mode="fwd_bwd",
         bias="out"),  # fmt: skip
    dict(kv_lora_rank=5, rotary="half", rotary_theta=50.0, kv_cache_len=6, seq_len=2),
    dict(kv_lora_rank=5, rotary="interleaved", kv_cache_len=6, seq_len=1, kv_cache="concat"),
    dict(kv_lora_rank=5, kv_cache_len=8, seq_len=2, kv_cache="paged", page_size=4),
    dict(kv_lora_rank=4, sinks=True, mask="causal", mode="fwd_bwd"),
    dict(kv_lora_rank=4, mask="sliding", window=3, need_weights=True),
    dict(kv_lora_rank=4, mask="sliding", window=3, mode="fwd_bwd"),
    dict(kv_lora_rank=4, mask="documents", documents=2, position_bias="alibi"),
    dict(kv_lora_rank=4, latent_v_dim=4, mask="causal", dtype="bfloat16", mode="fwd_bwd"),
]


@pytest.mark.parametrize("options", FORMS, ids=lambda o: ",".join(o.values()) or "naive")
@pytest.mark.parametrize("fields", POINTS, ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()))
def test_both_forms_match_the_oracle(fields, options):
    row = verify("latent", **{**SMALL, **fields}, variant=options)
    assert row["status"] == "ok", row.get("error") or row.get("reason")


def test_nn_mha_handed_the_same_model_matches_and_others_cannot_run_it():
    fields = dict(kv_lora_rank=4, rotary="half", mask="causal", mode="fwd_bwd")
    assert verify("reference", **{**SMALL, **fields})["status"] == "ok"
    row = verify("fused", **{**SMALL, **fields})
    assert row["status"] == "unsupported" and "takes no latent" in row["error"]
    row = verify("latent", **SMALL)  # no latent at the point: nothing to run
    assert row["status"] == "unsupported" and "kv_lora_rank > 0" in row["error"]


@pytest.mark.parametrize(
    "keys, said",
    [
        (dict(kv_lora_rank=4, cross=True), "cross=True with kv_lora_rank=4"),
        (dict(kv_lora_rank=4, num_kv_heads=2), "num_kv_heads=2 with kv_lora_rank=4"),
        (dict(kv_lora_rank=4, qk_norm="head"), "qk_norm=head with kv_lora_rank=4"),
        (dict(kv_lora_rank=4, bias=True), "bias=True with kv_lora_rank=4"),
        (dict(q_lora_rank=4), "q_lora_rank=4 applies with kv_lora_rank > 0"),
        (dict(kv_lora_rank=-1), "kv_lora_rank=-1 must be a rank >= 0"),
        (dict(kv_lora_rank=4, latent_v_dim=7), "latent_v_dim=7 must be a positive number"),
        (dict(kv_lora_rank=4, latent_rope_dim=6), "latent_rope_dim=6 must be a positive number"),
        (dict(kv_lora_rank=4, rotary="half", latent_rope_dim=3), "rotary turns pairs"),
        (dict(kv_lora_rank=4, rotary="half", rotary_fraction=1.0), "the rope channels turn"),
    ],
)
def test_a_bad_latent_point_is_one_line_naming_the_value(keys, said):
    with pytest.raises(InvalidPoint) as raised:
        make_point("latent", **{**SMALL, "bias": False, **keys})
    assert said in str(raised.value) and "\n" not in str(raised.value), str(raised.value)


def test_rotary_fraction_follows_the_rope_channels():
    p = make_point("latent", **SMALL, kv_lora_rank=4, rotary="half", latent_rope_dim=2)
    assert p.rotary_fraction == pytest.approx(2 / 6)


# Mistakes written into the module itself, as a third party would make them.


class RopeKeyFirstHead(LatentAttention):
    def project(self, query, key, value):
        q, k, v = super().project(query, key, value)
        keep = torch.zeros(self.num_heads, 1, 1, dtype=k.dtype)
        keep[0] = 1
        rope = k[..., : self.spec["rope"]] * keep  # only head 0 got the shared rope key
        return q, torch.cat([rope, k[..., self.spec["rope"] :]], dim=-1), v


class NormSkipped(LatentAttention):
    def latent(self, x):
        return F.linear(x, self.kv_down)  # kv_a_layernorm forgotten


class AbsorbedUntransposed(LatentAttention):
    def absorb(self, q_nope, k_up):  # (H, d_n, r) used as its transpose: square here
        return super().absorb(q_nope, k_up.transpose(1, 2))


class ScaledByNope(LatentAttention):
    def queries(self, query):  # scores * sqrt(D / d_n): scaled by 1/sqrt(d_n), not 1/sqrt(D)
        D = self.head_dim
        return super().queries(query) * (D / (D - self.spec["rope"])) ** 0.5


@pytest.mark.parametrize(
    "cls, options, name",
    [
        (RopeKeyFirstHead, {}, "latent_rope_key_first_head"),
        (NormSkipped, {"form": "absorbed"}, "latent_norm_skipped"),
        (AbsorbedUntransposed, {"form": "absorbed"}, "latent_absorbed_untransposed"),
        (ScaledByNope, {}, "latent_scale_without_rope"),
    ],
)
def test_a_mistake_in_a_module_is_named(cls, options, name):
    fields = dict(kv_lora_rank=4, mask="causal", mode="fwd_bwd", **SMALL)
    for dtype in ("float32", "bfloat16"):
        row = verify(f"tests.test_latent.{cls.__name__}", **fields, dtype=dtype, variant=options)
        assert row["status"] == "mismatch" and row["diagnosis"] == name, (
            dtype, row.get("diagnosis"), row.get("error"),
        )  # fmt: skip


# transformers' own MLA (examples/hf_deepseek_v3.py): its latent norms, kv_b_proj per head, its
# [nope; rope] heads and rotation, and mistakes planted in it.

DEEPSEEK = "examples.hf_deepseek_v3.DeepseekV3MHA"
DS_SHAPE = dict(batch=2, embed_dim=40, num_heads=4, device="cpu", bias=False, kv_lora_rank=8,
                latent_rope_dim=4)  # fmt: skip
DS_CASES = {
    "backward q latent interleaved": dict(seq_len=6, q_lora_rank=12, latent_v_dim=8,
                                          rotary="interleaved", mask="causal", mode="fwd_bwd"),
    "decode static half": dict(seq_len=2, kv_cache_len=5, q_lora_rank=12, rotary="half",
                               rotary_theta=50.0),
    "decode concat padding": dict(seq_len=1, kv_cache_len=7, kv_cache="concat", mask="padding",
                                  rotary="interleaved"),
    "bfloat16 sdpa": dict(seq_len=6, latent_v_dim=6, mask="causal", dtype="bfloat16"),
}


def transformers():
    pytest.importorskip(
        "transformers.models.deepseek_v3",
        reason="transformers (with DeepSeek-V3) is not installed here: bash "
        "scripts/install-beside-torch.sh transformers (CI installs it)",
    )


@pytest.mark.parametrize("case", list(DS_CASES))
def test_deepseek_v3s_own_latent_attention_matches_the_oracle(case):
    transformers()
    impl = "sdpa" if "sdpa" in case else "eager"
    row = verify(DEEPSEEK, **DS_SHAPE, **DS_CASES[case], variant={"attn_implementation": impl})
    assert row["status"] == "ok", (row["status"], row["error"], row["diagnosis"])
    assert "transformers" in row["variant_distribution"]


def _split_per_projection(self, kv_nope, k_rot):
    """DeepseekV3Attention.expand_kv reading kv_b_proj's rows as [all keys; all values]."""
    B, _, S, _ = kv_nope.shape
    H, n = self.num_heads, self.qk_nope_head_dim
    kv = self.kv_b_proj(kv_nope)[:, 0]  # (B, S, H * (n + v))
    k_nope = kv[..., : H * n].view(B, S, H, n).transpose(1, 2)
    values = kv[..., H * n :].view(B, S, H, -1).transpose(1, 2)
    return torch.cat([k_nope, k_rot.expand(-1, H, -1, -1)], dim=-1), values


@pytest.mark.parametrize(
    "patch, case, name",
    [
        (("DeepseekV3Attention", "expand_kv", _split_per_projection),
         "backward q latent interleaved", "latent_kv_split_per_projection"),
        # without a q latent: its RMSNorm is then the latent's alone
        (("DeepseekV3RMSNorm", "forward", lambda self, x: x), "decode concat padding",
         "latent_norm_skipped"),
    ],
)  # fmt: skip
def test_a_mistake_planted_in_deepseek_v3_is_named(patch, case, name, monkeypatch):
    transformers()
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as library

    cls, attribute, wrong = patch
    monkeypatch.setattr(getattr(library, cls), attribute, wrong)
    row = verify(DEEPSEEK, **DS_SHAPE, **DS_CASES[case])
    assert row["status"] == "mismatch", (row["status"], row["error"])
    assert row["diagnosis"] == name, (row["diagnosis"], row["error"])


@pytest.mark.parametrize("q_rank", [0, 6])
def test_the_work_model_counts_what_the_naive_form_multiplies(q_rank):
    """A latent row's FLOPs are MLA's (low-rank projections, values over d_v), not nn.MHA's dense
    count: torch's own FLOP counter over the naive form (no mask, so no causal halving), and a
    decode step's least bytes grow by the latent (d_r + r per token) with the cache."""
    from torch.utils.flop_counter import FlopCounterMode

    from harness.features import latent
    from harness.point import identity_of

    p = make_point("latent", batch=2, seq_len=8, embed_dim=32, num_heads=4, kv_lora_rank=5,
                   q_lora_rank=q_rank, bias=False, mask="none", device="cpu",
                   variant={"attention": "manual"})  # fmt: skip
    m = LatentAttention(32, 4, attention="manual", latent=latent.spec(p))
    x = torch.randn(2, 8, 32)
    with FlopCounterMode(display=False) as counted, torch.no_grad():
        m(x, x, x, need_weights=False)
    assert identity_of(p).flops == counted.get_total_flops() > 0
    decode = dict(batch=2, seq_len=1, kv_cache="static", device="cpu", bias=False,
                  kv_lora_rank=5, embed_dim=32, num_heads=4)  # fmt: skip
    rows = [identity_of(make_point("latent", kv_cache_len=P, **decode)) for P in (64, 1064)]
    d_r = rows[0].head_dim // 4
    assert rows[1].bytes_per_call - rows[0].bytes_per_call == 4 * 1000 * 2 * (5 + d_r)
