"""Rotary position embeddings (RoPE; Su et al. 2021: Llama, Qwen, Mistral, GPT-NeoX, gpt-oss),
``rotary=half|interleaved``: each query and key is rotated by its position before q . k, pair of
channels i by the angle position * inv_freq_i, so that a score depends on the keys' distance.

nn.MultiheadAttention has no positions: the oracle is nn.MHA fed the projections this rotates,
through an identity in-projection (harness/way/transformed.py, whose ``qk`` steps these are), in
float64, its own weights projecting them, so that every gradient is nn.MHA's. The layouts: ``half``
rotates channel i with channel i + r/2 (GPT-NeoX's and Llama's ``rotate_half``), ``interleaved``
channel 2i with 2i + 1 (GPT-J's, Meta's original); only the first r = head_dim * rotary_fraction
channels of a head turn (partial rotary: GPT-NeoX's ``rotary_pct``, Phi). The scalings are
transformers' (``rope_type``): ``linear`` (positions / factor), ``llama3`` (low 1, high 4) and
``yarn`` (beta_fast 32, beta_slow 1, its attention factor on cos and sin; ``yarn_untruncated``:
its correction range not rounded, gpt-oss's ``truncate: false``), the last from a pre-training
context of ``rotary_original`` tokens. The queries are the last L of the S positions
(a decode step's new tokens continue from the cache's length). Vocabulary: H heads, D head_dim,
r rotated channels, T positions.
"""

from __future__ import annotations

import math

from harness.features import Feature, shown, torch
from harness.keys import key
from harness.validate import InvalidPoint, number

LAYOUTS = ("none", "half", "interleaved")
SCALINGS = ("none", "linear", "llama3", "yarn", "yarn_untruncated")
THETA, ORIGINAL = 10000.0, 4096  # what a null rotary_theta and rotary_original read as


def spec(point) -> dict:
    """The point's rotary embeddings, as a module's constructor is handed them (``rotary=``)."""
    return dict(
        layout=point.rotary,
        theta=point.rotary_theta,
        fraction=point.rotary_fraction,
        scaling=point.rotary_scaling,
        factor=point.rotary_factor,
        original=point.rotary_original,
    )


def inv_freq(s: dict, D: int):
    """(r/2,) float64 and the attention factor on cos and sin: transformers' formulas per scaling
    (modeling_rope_utils), for a head of D channels."""
    r = rotated(s, D)
    base = s["theta"] ** (torch.arange(0, r, 2, dtype=torch.float64) / r)  # (r/2,)
    freq, factor, attention = 1.0 / base, s["factor"], 1.0
    if s["scaling"] == "linear":
        freq = freq / factor
    elif s["scaling"] == "llama3":
        low, high = s["original"] / 1.0, s["original"] / 4.0  # wavelengths: low and high factors
        wavelen = 2 * math.pi / freq
        scaled = torch.where(wavelen > low, freq / factor, freq)
        smooth = (s["original"] / wavelen - 1.0) / (4.0 - 1.0)
        medium = (wavelen >= high) & (wavelen <= low)
        freq = torch.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled)
    elif s["scaling"] in ("yarn", "yarn_untruncated"):

        def dim_of(rotations):  # the channel whose wavelength turns ``rotations`` times
            turns = s["original"] / (rotations * 2 * math.pi)
            return r * math.log(turns) / (2 * math.log(s["theta"]))

        lo, hi = dim_of(32.0), dim_of(1.0)
        if s["scaling"] == "yarn":  # the correction range rounded outwards (truncate=True)
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, r - 1)
        hi = hi + 0.001 if hi == lo else hi
        ramp = ((torch.arange(r // 2, dtype=torch.float64) - lo) / (hi - lo)).clamp(0, 1)
        freq = freq / factor * ramp + freq * (1 - ramp)
        attention = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
    return freq, attention


def rotated(s: dict, D: int) -> int:
    """r, the channels of a head that turn (an even number)."""
    return int(D * s["fraction"] + 1e-6) // 2 * 2  # 44 * (30 / 44) is 29.99...


def angles(s: dict, D: int, positions, dtype=None):
    """cos and sin (T, r/2) at ``positions`` (T,), the attention factor in them; computed in
    float64 on the CPU (``dtype``: the positions and frequencies in another, as a module may)."""
    freq, attention = inv_freq(s, D)
    positions = positions.cpu()
    if dtype is not None:
        theta = positions.to(dtype).view(-1, 1) * freq.to(dtype).view(1, -1)
    else:
        theta = positions.to(torch.float64).view(-1, 1) * freq.view(1, -1)
    theta = theta.to(torch.float64)
    return theta.cos() * attention, theta.sin() * attention


def turn(x, cos, sin, layout: str):
    """x (B, H, T, D) with its first r channels rotated (cos, sin: (T, r/2), r/2 = cos's width)."""
    half = cos.size(-1)
    r = 2 * half
    head, rest = x[..., :r], x[..., r:]
    cos, sin = cos.to(x.device, x.dtype), sin.to(x.device, x.dtype)
    if layout == "half":  # channel i with channel i + r/2
        a, b = head[..., :half], head[..., half:]
        head = torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
    else:  # channel 2i with 2i + 1
        a, b = head[..., 0::2], head[..., 1::2]
        head = torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)
    return torch.cat([head, rest], dim=-1)


def rotary(m, q, k, v, qpos, kpos):
    """The right step: q (B, H, L, D) and k (B, H, S, D) rotated at their positions; v as it is.
    ``m.rotary``: the point's rotary embeddings (``spec``), as a module that applies them takes
    them (harness/way/steps.py's ``Math``, harness/way/transformed.py's oracle). Its angles in
    float64 for float64 heads (the oracle), else in float32, as a model computes them (nn.MHA in
    the point's dtype, whose error the tolerance is scaled by, rounds as a module does)."""
    s, D = m.rotary, q.size(-1)
    at = None if q.dtype == torch.float64 else torch.float32
    q = turn(q, *angles(s, D, qpos, at), s["layout"])
    return q, turn(k, *angles(s, D, kpos, at), s["layout"]), v


class Rotary(Feature):
    keys = {
        "rotary": key(
            "none",
            "{choices}: rotary position embeddings, each head's pairs of channels turned by "
            "position (half: channel i with i + r/2, GPT-NeoX's and Llama's rotate_half; "
            "interleaved: 2i with 2i + 1, GPT-J's); nn.MHA is fed the rotated projections; a "
            "module applies them itself (its class takes rotary); refused with cross=true",
            role="shape",
            choices=LAYOUTS,
            after="qk_norm_eps",  # QK-norm's step runs first: the features run in keys' order
        ),
        "rotary_theta": key(
            None, "the base of the rotary frequencies (null: 10000; Llama 3 500000)", role="shape",
            after="rotary",
        ),  # fmt: skip
        "rotary_fraction": key(
            None, "the fraction of each head's channels that turn (null: 1; GPT-NeoX 0.25)",
            role="shape", after="rotary_theta",
        ),  # fmt: skip
        "rotary_scaling": key(
            "none",
            "{choices}: the frequencies scaled for a longer context, as transformers' rope_type",
            role="shape", choices=SCALINGS, after="rotary_fraction",
        ),  # fmt: skip
        "rotary_factor": key(
            None, "the scaling's factor (null: 1, no scaling)", role="shape",
            after="rotary_scaling",
        ),  # fmt: skip
        "rotary_original": key(
            None, "llama3's and yarn's pre-training context in tokens (null: 4096)",
            role="shape", after="rotary_factor",
        ),  # fmt: skip
    }
    steps = {"rotary": ("qk", rotary)}
    required = True
    needs = "rotary embeddings: docs/adding.md says how a module takes them"
    examples = (
        dict(rotary="half", rotary_fraction=0.5, mask="causal", mode="fwd_bwd"),
        dict(rotary="interleaved", rotary_theta=500.0, rotary_scaling="linear", rotary_factor=2.0,
             kv_cache_len=7, seq_len=2),  # fmt: skip
        dict(rotary="half", rotary_scaling="yarn", rotary_factor=4.0, rotary_original=8,
             kv_cache_len=300, seq_len=1),  # fmt: skip
    )

    def active(self, point) -> bool:
        return point.rotary != "none"

    def check(self, point, set_) -> None:
        others = ("rotary_theta", "rotary_fraction", "rotary_factor", "rotary_original")
        if not self.active(point):
            for name in (*others, "rotary_scaling"):
                value = getattr(point, name)
                if value not in (None, "none"):
                    raise InvalidPoint(f"{name}={value!r} applies with rotary=half|interleaved")
            return
        if point.cross is True:
            raise InvalidPoint(
                f"rotary={point.rotary} with cross=true: positions are one sequence's"
            )
        for name, default in zip(others, (THETA, 1.0, 1.0, ORIGINAL)):
            if getattr(point, name) is None:
                set_(name, default)
        number("rotary_theta", point.rotary_theta, 1, above=True, unit="a number above 1")
        number("rotary_fraction", point.rotary_fraction, 0, above=True, below=1.0000001,
               unit="a fraction in (0, 1]")  # fmt: skip
        number("rotary_factor", point.rotary_factor, 1, unit="a number >= 1")
        number("rotary_original", point.rotary_original, 0, above=True, integer=True,
               unit="a positive number of tokens")  # fmt: skip
        if (point.rotary_scaling == "none") != (point.rotary_factor == 1):
            raise InvalidPoint(
                f"rotary_factor={point.rotary_factor:g} with rotary_scaling="
                f"{point.rotary_scaling}: a factor above 1 needs a scaling, a scaling a factor"
            )
        if rotated(spec(point), point.head_dim) < 2:
            raise InvalidPoint(
                f"rotary_fraction={point.rotary_fraction:g} of head_dim={point.head_dim} turns "
                "no pair of channels"
            )

    def argument(self, point) -> dict:
        return {"rotary": spec(point)}

    def case(self, row: dict) -> str:
        layout = shown(row, "rotary", "none")
        if layout is None:
            return ""
        scaling = shown(row, "rotary_scaling", "none")
        return f" rope={layout}" + ("" if scaling is None else f":{scaling}")


FEATURE = Rotary()


def _on(p) -> bool:
    return FEATURE.active(p)


@FEATURE.mistake(
    "rotary",
    "the rotary layout swapped (half-split pairs where they are interleaved, or the reverse)",
    "rotate channel i with i + r/2 for rotate_half models (Llama), 2i with 2i + 1 for GPT-J's; "
    "or permute q's and k's rows when converting the weights",
)
def rotary_layout_swapped(m, q, k, v, qpos, kpos):
    s, D = m.rotary, q.size(-1)
    other = "interleaved" if s["layout"] == "half" else "half"
    return turn(q, *angles(s, D, qpos), other), turn(k, *angles(s, D, kpos), other), v


@FEATURE.mistake(
    "rotary",
    "a decode step's positions counted from 0 (its new tokens rotated as if first)",
    "rotate the new tokens at positions P .. P + L - 1: offset by the cache's length",
    lambda p: _on(p) and p.kv_cache_len is not None,
)
def rotary_decode_from_zero(m, q, k, v, qpos, kpos):
    L, S, P = q.size(2), k.size(2), m.point.kv_cache_len
    # every call's tokens at 0 .. L - 1: the prefix's (filled in one call) where they belong, and
    # each decode step's (the check's steps are L tokens each) cached as it turned them
    new = torch.arange(L)
    return rotary(m, q, k, v, new, torch.cat([torch.arange(P), torch.arange(S - P) % L]))


@FEATURE.mistake(
    "rotary",
    "the rotary base left at 10000 (rope_theta not read from the model)",
    "rotate with the model's rope_theta",
    lambda p: _on(p) and p.rotary_theta != THETA,
)
def rotary_default_theta(m, q, k, v, qpos, kpos):
    s, D = dict(m.rotary, theta=THETA), q.size(-1)
    return turn(q, *angles(s, D, qpos), s["layout"]), turn(k, *angles(s, D, kpos), s["layout"]), v


@FEATURE.mistake(
    "rotary",
    "every channel of a head turned under partial rotary",
    "turn only the first head_dim * rotary_fraction channels of each head",
    lambda p: _on(p) and p.rotary_fraction < 1,
)
def rotary_whole_head(m, q, k, v, qpos, kpos):
    s, D = dict(m.rotary, fraction=1.0), q.size(-1)
    return turn(q, *angles(s, D, qpos), s["layout"]), turn(k, *angles(s, D, kpos), s["layout"]), v


@FEATURE.mistake(
    "rotary",
    "the rotary scaling ignored (the pre-training frequencies at every length)",
    "scale the frequencies (and cos, sin) as the model's rope_scaling says",
    lambda p: _on(p) and p.rotary_scaling != "none",
)
def rotary_unscaled(m, q, k, v, qpos, kpos):
    s, D = dict(m.rotary, scaling="none", factor=1.0), q.size(-1)
    return turn(q, *angles(s, D, qpos), s["layout"]), turn(k, *angles(s, D, kpos), s["layout"]), v


@FEATURE.mistake(
    "rotary",
    "the values rotated too (rotary applied to v)",
    "rotate the queries and keys only",
)
def rotary_on_values(m, q, k, v, qpos, kpos):
    q, k, _ = rotary(m, q, k, v, qpos, kpos)
    s = m.rotary
    return q, k, turn(v, *angles(s, v.size(-1), kpos), s["layout"])


@FEATURE.mistake(
    "rotary",
    "the keys not rotated (the queries only)",
    "rotate the keys as the queries, each at its own position",
)
def rotary_queries_only(m, q, k, v, qpos, kpos):
    return rotary(m, q, k, v, qpos, kpos)[0], k, v


@FEATURE.mistake(
    "rotary",
    "the rotary angles computed in bfloat16 (positions past 256 rounded)",
    "compute position * inv_freq, cos and sin in float32, then cast",
    lambda p: _on(p) and (p.kv_cache_len or 0) + p.seq_len > 256,
)
def rotary_low_precision(m, q, k, v, qpos, kpos):
    s, D, low = m.rotary, q.size(-1), torch.bfloat16
    q = turn(q, *angles(s, D, qpos, low), s["layout"])
    return q, turn(k, *angles(s, D, kpos, low), s["layout"]), v
