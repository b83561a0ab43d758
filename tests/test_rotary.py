"""Rotary embeddings, checked (harness/features/rotary.py, issue 70).

The oracle (nn.MHA fed the rotated float64 projections, harness/way/transformed.py) is held
against an independent statement of RoPE (the paper's: each pair of channels a complex number
multiplied by e^{i * position * inv_freq}) and against transformers' own frequencies and
``apply_rotary_pos_emb``; the hand-written ways match it under every kernel, at prefill, backward
and decode; what a point cannot mean is refused in one line; and a real library module with its
rotation planted wrong is named by the diagnosis (transformers' Llama, its layout swapped, its
decode positions restarted)."""

from __future__ import annotations

import pytest
import torch

from harness import verify
from harness.factory import make_point
from harness.features.rotary import angles, inv_freq, turn
from harness.validate import InvalidPoint
from harness.way.transformed import Transformed
from variants.rotary import frequencies

SHAPE = dict(batch=2, embed_dim=32, num_heads=4, device="cpu")
SCALINGS = {  # scaling: factor, each changing the frequencies at original=64
    "none": 1.0, "linear": 2.0, "llama3": 8.0, "yarn": 4.0, "yarn_untruncated": 32.0,
}  # fmt: skip


def spec(**changes) -> dict:
    base = dict(layout="half", theta=50000.0, fraction=1.0, scaling="none", factor=1.0,
                original=64)  # fmt: skip
    return {**base, **changes}


def transformers():
    return pytest.importorskip(
        "transformers",
        reason="transformers is not installed here: bash scripts/install-beside-torch.sh "
        "transformers (CI installs it)",
    )


def as_complex(x, s, positions):
    """The paper's RoPE (Su et al. 2021, eq. 34), apart from ``turn``: the first r channels of
    x (B, H, T, D) as r/2 complex numbers, each multiplied by e^{i t theta_j}; ``half`` pairs
    channel j with j + r/2, ``interleaved`` 2j with 2j + 1."""
    D = x.size(-1)
    r = int(D * s["fraction"]) // 2 * 2
    freq, attention = inv_freq(s, D)
    phase = torch.polar(torch.ones(()), torch.zeros(())).to(torch.complex128)  # 1
    phase = torch.exp(1j * positions.double().view(-1, 1) * freq.view(1, -1)) * attention * phase
    head = x[..., :r].double()
    if s["layout"] == "half":
        z = torch.complex(head[..., : r // 2], head[..., r // 2 :]) * phase
        head = torch.cat([z.real, z.imag], dim=-1)
    else:
        z = torch.complex(head[..., 0::2], head[..., 1::2]) * phase
        head = torch.stack([z.real, z.imag], dim=-1).flatten(-2)
    return torch.cat([head, x[..., r:].double()], dim=-1)


@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("fraction", [1.0, 0.25])
@pytest.mark.parametrize("scaling", list(SCALINGS))
def test_the_oracles_rotation_is_the_papers(layout, fraction, scaling):
    s = spec(layout=layout, fraction=fraction, scaling=scaling, factor=SCALINGS[scaling])
    x = torch.randn(2, 3, 9, 16, dtype=torch.float64)
    positions = torch.arange(1000, 1009)
    got = turn(x, *angles(s, 16, positions), layout)
    torch.testing.assert_close(got, as_complex(x, s, positions), rtol=1e-12, atol=1e-12)
    if fraction < 1:  # the channels past r are untouched
        assert torch.equal(got[..., 4:], x[..., 4:])
    # and a rotation preserves each pair's length, but for the attention factor (YaRN's)
    norms = got[..., : int(16 * fraction)].norm(dim=-1) / x[..., : int(16 * fraction)].norm(dim=-1)
    torch.testing.assert_close(norms, torch.full_like(norms, inv_freq(s, 16)[1]))


def test_the_oracle_is_nn_mha_fed_the_rotated_projections():
    """``Transformed`` with the rotary step against softmax(rot(q) rot(k)^T / sqrt(D)) v written
    here from nn.MHA's weights and the paper's rotation; without steps it is nn.MHA itself."""
    from harness.features.rotary import rotary

    torch.manual_seed(0)
    E, H, B, L = 32, 4, 2, 7
    mha = torch.nn.MultiheadAttention(E, H, batch_first=True).double()
    plain = Transformed(E, H).double()
    plain.load_state_dict(mha.state_dict())
    x = torch.randn(B, L, E, dtype=torch.float64)
    causal = torch.ones(L, L, dtype=torch.bool).triu(1)
    assert torch.equal(plain(x, x, x, attn_mask=causal)[0], mha(x, x, x, attn_mask=causal)[0])

    s = spec(layout="interleaved", scaling="yarn", factor=4.0)
    oracle = Transformed(E, H, steps=(rotary,), rotary=s).double()
    oracle.load_state_dict(mha.state_dict())  # nn.MHA's state dict, nothing added
    got = oracle(x, x, x, attn_mask=causal, need_weights=False)[0]
    wq, wk, wv = mha.in_proj_weight.chunk(3)
    bq, bk, bv = mha.in_proj_bias.chunk(3)

    def heads(t):  # (B, L, E) -> (B, H, L, D)
        return t.view(B, L, H, E // H).transpose(1, 2)

    positions = torch.arange(L)
    q = as_complex(heads(x @ wq.T + bq), s, positions)
    k = as_complex(heads(x @ wk.T + bk), s, positions)
    scores = (q @ k.transpose(-1, -2) / (E // H) ** 0.5).masked_fill(causal, float("-inf"))
    out = (scores.softmax(-1) @ heads(x @ wv.T + bv)).transpose(1, 2).reshape(B, L, E)
    want = mha.out_proj(out)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("scaling", list(SCALINGS))
def test_the_frequencies_are_transformers(scaling):
    """Both rotations' frequencies and attention factor (the oracle's float64, the ways' float32)
    against transformers' own LlamaRotaryEmbedding, built from the config the adapters hand it."""
    transformers()
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from variants.library_rotary import rope_config

    s = spec(scaling=scaling, factor=SCALINGS[scaling])
    config = LlamaConfig(hidden_size=128, num_attention_heads=2, num_key_value_heads=2,
                         head_dim=64, **rope_config(s))  # fmt: skip
    rope = LlamaRotaryEmbedding(config)
    want = rope.inv_freq.double()
    oracle, attention = inv_freq(s, 64)
    torch.testing.assert_close(oracle, want, rtol=1e-6, atol=0)
    assert attention == pytest.approx(rope.attention_scaling, rel=1e-12)
    ways, factor = frequencies(s, 64)
    torch.testing.assert_close(ways.double(), want, rtol=1e-6, atol=0)
    assert factor == pytest.approx(rope.attention_scaling, rel=1e-12)
    if scaling != "none":  # the scaling did change them (else the comparison proves little)
        assert not torch.allclose(oracle, inv_freq(spec(), 64)[0])


def test_the_half_layout_is_transformers_apply_rotary_pos_emb():
    transformers()
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    s = spec(scaling="llama3", factor=8.0)
    q, k = torch.randn(2, 4, 5, 16, dtype=torch.float64), torch.randn(2, 4, 5, 16).double()
    positions = torch.arange(3000, 3005)
    cos, sin = angles(s, 16, positions)  # (T, r/2): transformers' are (B, T, D), halves repeated
    want_q, want_k = apply_rotary_pos_emb(q, k, torch.cat([cos, cos], -1)[None],
                                          torch.cat([sin, sin], -1)[None])  # fmt: skip
    torch.testing.assert_close(turn(q, cos, sin, "half"), want_q, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(turn(k, cos, sin, "half"), want_k, rtol=1e-12, atol=1e-12)


ROTARY_POINTS = {
    "prefill causal": dict(seq_len=12, mask="causal", rotary="half"),
    "backward partial": dict(seq_len=8, mask="causal", rotary="half", rotary_fraction=0.5,
                             mode="fwd_bwd"),  # fmt: skip
    "decode interleaved": dict(seq_len=2, kv_cache_len=9, rotary="interleaved",
                               rotary_theta=500000.0, rotary_scaling="llama3", rotary_factor=8.0,
                               rotary_original=8),  # fmt: skip
    "decode padding yarn": dict(seq_len=1, kv_cache_len=20, mask="padding", rotary="half",
                                rotary_scaling="yarn", rotary_factor=4.0, rotary_original=8),
    "grouped window": dict(seq_len=12, mask="sliding", window=4, num_kv_heads=2,
                           rotary="interleaved"),  # fmt: skip
}


@pytest.mark.parametrize("attention", ["manual", "sdpa", "flex"])
@pytest.mark.parametrize("case", list(ROTARY_POINTS))
@pytest.mark.parametrize("way", ["fused", "separate", "packed"])
def test_the_hand_written_ways_match_at_rotary_points(way, case, attention):
    fields = ROTARY_POINTS[case]
    row = verify(way, **SHAPE, **fields, variant={"attention": attention})
    if row["status"] == "unsupported":  # a kernel that cannot take the point says why
        assert row["error"] and "rotary" not in row["error"], row["error"]
        pytest.skip(row["error"])
    assert row["status"] == "ok", (row["status"], row["error"], row.get("diagnosis"))
    assert row["rotary"] == fields["rotary"]


def test_reference_is_the_oracle_in_the_points_dtype():
    row = verify("reference", **SHAPE, **ROTARY_POINTS["decode padding yarn"], dtype="bfloat16")
    assert row["status"] == "ok", row["error"]


@pytest.mark.parametrize(
    "fields, words",
    [
        (dict(rotary="half", cross=True, kv_seq_len=9), "rotary=half with cross=true"),
        (dict(rotary="half", rotary_factor=2.0), "rotary_factor=2 with rotary_scaling=none"),
        (dict(rotary="half", rotary_scaling="yarn"), "rotary_factor=1 with rotary_scaling=yarn"),
        (dict(rotary="half", rotary_fraction=0.1), "rotary_fraction=0.1 of head_dim=8 turns"),
        (dict(rotary="half", rotary_fraction=1.5), "rotary_fraction"),
        (dict(rotary="half", rotary_theta=1.0), "rotary_theta"),
        (dict(rotary_theta=500000.0), "rotary_theta=500000.0 applies with rotary=half"),
        (dict(rotary="spiral"), "rotary"),
    ],
)
def test_what_a_point_cannot_mean_is_refused_in_one_line(fields, words):
    with pytest.raises((InvalidPoint, ValueError)) as raised:
        make_point("fused", **SHAPE, seq_len=8, **fields)
    message = str(raised.value)
    assert words in message and "\n" not in message, message


def test_a_module_without_rotary_is_unsupported_at_a_rotary_point_not_wrong():
    class NoRotary(torch.nn.MultiheadAttention):
        def __init__(self, embed_dim, num_heads, bias=True):
            super().__init__(embed_dim, num_heads, bias=bias, batch_first=True)

    import sys

    sys.modules[__name__].NoRotary = NoRotary
    row = verify(f"{__name__}.NoRotary", **SHAPE, seq_len=8, rotary="half")
    assert row["status"] == "unsupported" and "rotary" in row["error"], row


# A real library module with its rotation planted wrong: the diagnosis names the mistake.
LLAMA = dict(batch=2, embed_dim=64, num_heads=8, num_kv_heads=2, device="cpu")


def _interleaved_apply(q, k, cos, sin, *args, **kwargs):
    """transformers' apply_rotary_pos_emb with the pairs interleaved: a GPT-J-style rotation in a
    rotate_half model (the bug a checkpoint converted without permuting q and k shows)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (B, 1, T, D), halves repeated
    half = cos.size(-1) // 2

    def rot(x):
        a, b = x[..., 0::2], x[..., 1::2]
        c, s = cos[..., :half], sin[..., :half]
        return torch.stack([a * c - b * s, b * c + a * s], dim=-1).flatten(-2)

    return rot(q), rot(k)


def test_transformers_llama_with_its_layout_swapped_is_named(monkeypatch):
    transformers()
    from transformers.models.llama import modeling_llama

    point = dict(**LLAMA, seq_len=12, mask="causal", rotary="half", rotary_theta=500000.0)
    row = verify("examples.hf_llama.LlamaMHA", **point)
    assert row["status"] == "ok", row["error"]  # the library's own rotation passes
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", _interleaved_apply)
    row = verify("examples.hf_llama.LlamaMHA", **point)
    assert row["status"] == "mismatch", row
    assert row["diagnosis"].startswith("rotary_layout_swapped"), row["diagnosis"]


def test_transformers_llama_decoding_from_position_zero_is_named(monkeypatch):
    transformers()
    from variants.library_rotary import Angles

    point = dict(**LLAMA, seq_len=2, kv_cache_len=10, rotary="half", kv_cache="concat")
    row = verify("examples.hf_llama.LlamaMHA", **point)
    assert row["status"] == "ok", row["error"]
    call = Angles.__call__
    monkeypatch.setattr(Angles, "__call__", lambda self, x, start: call(self, x, 0))
    row = verify("examples.hf_llama.LlamaMHA", **point)
    assert row["status"] == "mismatch", row
    assert row["diagnosis"].startswith("rotary_decode_from_zero"), row["diagnosis"]


def test_the_angles_in_bfloat16_at_long_positions_are_named(monkeypatch):
    """Past a few thousand positions bfloat16 cannot hold position * inv_freq: the ways' cos and
    sin made in bfloat16 (as a module that builds them in the model's dtype) fail, and are named;
    in float32 (variants/rotary.py) they pass."""
    point = dict(**SHAPE, seq_len=1, kv_cache_len=4000, rotary="half", dtype="bfloat16")
    row = verify("fused", **point)
    assert row["status"] == "ok", row["error"]
    from variants import rotary as ways

    def low(self, start, T, dtype, device):
        t = torch.arange(start, start + T, dtype=torch.bfloat16)
        theta = t.view(-1, 1) * self.freq.to(torch.bfloat16).view(1, -1)
        return theta.cos().to(device, dtype), theta.sin().to(device, dtype)

    monkeypatch.setattr(ways.Rotary, "angles", low)
    row = verify("fused", **point)
    assert row["status"] == "mismatch", row
    assert "rotary_low_precision" in row["diagnosis"], row["diagnosis"]


class MetaStyle(torch.nn.Module):
    """Rotary attention as Meta's original Llama code writes it (llama/model.py: freqs_cis by
    ``torch.polar``, q and k viewed as complex pairs of adjacent channels): written apart from the
    harness, its layout interleaved whatever it is told. Without a KV cache, a decode point hands
    it the new tokens against the whole sequence: the queries are the last L positions."""

    def __init__(self, embed_dim, num_heads, bias=True, rotary=None):
        super().__init__()
        if rotary is None or rotary["scaling"] != "none" or rotary["fraction"] != 1:
            raise NotImplementedError("Meta's rotary: whole heads, no scaling")
        self.H, self.D = num_heads, embed_dim // num_heads
        self.wq, self.wk, self.wv, self.wo = (
            torch.nn.Linear(embed_dim, embed_dim, bias=bias) for _ in range(4)
        )
        self.theta = rotary["theta"]
        self._register_load_state_dict_pre_hook(self.load_hook)

    def load_hook(self, state_dict, prefix, *args):
        for part in ("weight", "bias"):
            packed = state_dict.pop(f"{prefix}in_proj_{part}", None)
            if packed is not None:
                for name, w in zip(("wq", "wk", "wv"), packed.chunk(3)):
                    state_dict[f"{prefix}{name}.{part}"] = w
            out = state_dict.pop(f"{prefix}out_proj.{part}", None)
            if out is not None:
                state_dict[f"{prefix}wo.{part}"] = out

    def freqs_cis(self, positions):  # (T, D/2) complex64
        freqs = 1.0 / (self.theta ** (torch.arange(0, self.D, 2)[: self.D // 2].float() / self.D))
        return torch.polar(torch.ones(len(positions), self.D // 2),
                           torch.outer(positions.float(), freqs))  # fmt: skip

    def rotate(self, x, positions):  # x (B, T, H, D)
        z = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        z = z * self.freqs_cis(positions).to(x.device).view(1, len(positions), 1, -1)
        return torch.view_as_real(z).flatten(3).type_as(x)

    def forward(self, query, key, value, key_padding_mask=None, need_weights=False,
                attn_mask=None, average_attn_weights=True, is_causal=False):  # fmt: skip
        B, L, E = query.shape
        S = key.size(1)
        q = self.rotate(self.wq(query).view(B, L, self.H, self.D), torch.arange(S - L, S))
        k = self.rotate(self.wk(key).view(B, S, self.H, self.D), torch.arange(S))
        v = self.wv(value).view(B, S, self.H, self.D)
        bias = torch.zeros(B, 1, L, S, dtype=q.dtype, device=q.device)
        for m, shape in ((attn_mask, (1, 1, L, S)), (key_padding_mask, (B, 1, 1, S))):
            if m is not None:
                m = m.view(shape)
                bias = bias + (torch.where(m, float("-inf"), 0.0) if m.dtype == torch.bool else m)
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=bias.to(q.dtype)
        )
        return self.wo(out.transpose(1, 2).reshape(B, L, E)), None


def test_metas_rotary_written_apart_passes_interleaved_and_is_named_when_told_half():
    import sys

    sys.modules[__name__].MetaStyle = MetaStyle
    target = f"{__name__}.MetaStyle"
    fails = []
    for fields in (dict(seq_len=10, mask="causal", mode="fwd_bwd"),
                   dict(seq_len=2, kv_cache_len=30, mask="padding"),
                   dict(seq_len=12, mask="sliding", window=3, dtype="bfloat16")):  # fmt: skip
        row = verify(target, **SHAPE, rotary="interleaved", rotary_theta=500000.0, **fields)
        if row["status"] != "ok":
            fails.append(f"{fields}: {row['status']} {row['error']}")
    assert not fails, "\n".join(fails)
    row = verify(target, **SHAPE, seq_len=10, mask="causal", rotary="half")
    assert row["status"] == "mismatch", row
    assert row["diagnosis"].startswith("rotary_layout_swapped"), row["diagnosis"]
