"""Rotary position embeddings as the hand-written ways apply them (``Rotary``), the point's
``rotary=`` spec (layout, theta, fraction, scaling, factor, original). harness/features/rotary.py
is the oracle's own, written apart so that the check compares two implementations: here, as in
transformers, the frequencies and angles are float32 and cos and sin are cast to q's dtype.

Vocabulary: B batch, H heads, T tokens, D head_dim, r channels that turn (D * fraction, even).
"""

from __future__ import annotations

import math

import torch

_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", lambda: False)


def frequencies(spec: dict, D: int) -> tuple[torch.Tensor, float]:
    """(r/2,) float32 inverse frequencies, after the scaling, and cos and sin's factor."""
    r = int(D * spec["fraction"] + 1e-6) // 2 * 2  # 44 * (30 / 44) is 29.99...
    freq = 1.0 / spec["theta"] ** (torch.arange(0, r, 2, dtype=torch.float32) / r)
    factor, scaling = spec["factor"], spec["scaling"]
    if scaling == "linear":
        return freq / factor, 1.0
    if scaling == "llama3":  # low_freq_factor 1, high_freq_factor 4
        wave = 2 * math.pi / freq
        low, high = spec["original"], spec["original"] / 4
        out = torch.where(wave > low, freq / factor, freq)
        ramp = (spec["original"] / wave - 1) / 3
        mid = (1 - ramp) * out / factor + ramp * out
        return torch.where((wave < high) | (wave > low), out, mid), 1.0
    if scaling in ("yarn", "yarn_untruncated"):  # beta_fast 32, beta_slow 1
        def channel(turns):
            wavelengths = spec["original"] / (turns * 2 * math.pi)
            return r * math.log(wavelengths) / (2 * math.log(spec["theta"]))

        lo, hi = channel(32), channel(1)
        if scaling == "yarn":  # transformers' truncate=True; gpt-oss's yarn_untruncated is not
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, r - 1)
        hi = hi if hi != lo else hi + 0.001
        ramp = ((torch.arange(r // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
        return freq / factor * ramp + freq * (1 - ramp), 0.1 * math.log(factor) + 1
    return freq, 1.0


class Rotary:
    """A module's rotary embeddings: ``turn(x, start)`` rotates x (B, H, T, D) at positions
    start .. start + T - 1; cos and sin are made once per start, length, dtype and device, outside
    the timed calls (under torch.compile inline, where the compiler fuses them)."""

    def __init__(self, spec: dict, head_dim: int):
        self.spec, self.layout = spec, spec["layout"]
        self.freq, self.attention = frequencies(spec, head_dim)
        self.made: dict = {}

    def angles(self, start: int, T: int, dtype, device):
        key = (start, T, dtype, device)
        if _compiling() or key not in self.made:
            t = torch.arange(start, start + T, dtype=torch.float32)
            theta = t.view(-1, 1) * self.freq.view(1, -1)  # (T, r/2)
            made = ((theta.cos() * self.attention).to(device, dtype),
                    (theta.sin() * self.attention).to(device, dtype))  # fmt: skip
            if _compiling():
                return made
            self.made[key] = made
        return self.made[key]

    def turn(self, x: torch.Tensor, start: int) -> torch.Tensor:
        cos, sin = self.angles(start, x.size(2), x.dtype, x.device)  # (T, r/2)
        half = cos.size(-1)
        head, rest = x[..., : 2 * half], x[..., 2 * half :]
        if self.layout == "half":
            a, b = head[..., :half], head[..., half:]
            head = torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
        else:
            a, b = head[..., 0::2], head[..., 1::2]
            head = torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)
        return torch.cat([head, rest], dim=-1)
