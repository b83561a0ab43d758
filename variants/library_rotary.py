"""A library's rotary embeddings behind the variant contract: the point's ``rotary=`` spec
(harness/features/rotary.py: layout, theta, fraction, scaling, factor, original) as transformers'
config says it (``rope_config``), the library's own rotary embedding module that computes cos and
sin from it (``library_rope``), and their cos and sin at a call's positions, made once per
positions (``Angles``). Where the point has no rotary embeddings, the identity rotation
(``identity_rotary``): nn.MHA has no positions, so a rotary module and nn.MHA agree only there.

Vocabulary: B batch, L new tokens, P cached ones, E embed_dim, D head_dim.
"""

from __future__ import annotations

import torch

from variants.libraries import library

# transformers' rope_type per harness scaling, and what else its rope_parameters then need
ROPE_TYPES = {"none": "default", "linear": "linear", "llama3": "llama3", "yarn": "yarn",
              "yarn_untruncated": "yarn"}  # fmt: skip


def identity_rotary(x: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of (B, L, D) for ``x`` (B, L, E) that rotate nothing: cos = 1, sin = 0."""
    B, L, _ = x.shape
    cos = torch.ones(B, L, head_dim, dtype=x.dtype, device=x.device)
    return cos, torch.zeros_like(cos)


def rope_config(rotary: dict | None) -> dict:
    """transformers' config keywords for the point's rotary embeddings (``rotary``, the spec a
    module's constructor is handed; None: {}, the library's defaults, which the identity rotation
    replaces): ``rope_parameters`` and, for the scalings that read it, ``max_position_embeddings``
    (the pre-training context times the factor, so that transformers' YaRN finds the factor it is
    given)."""
    if rotary is None:
        return {}
    parameters = {
        "rope_type": ROPE_TYPES[rotary["scaling"]],
        "rope_theta": float(rotary["theta"]),
        "partial_rotary_factor": float(rotary["fraction"]),
    }
    out = {}
    if rotary["scaling"] != "none":
        parameters["factor"] = float(rotary["factor"])
    if rotary["scaling"] in ("llama3", "yarn", "yarn_untruncated"):
        parameters["original_max_position_embeddings"] = int(rotary["original"])
        out["max_position_embeddings"] = int(rotary["original"] * rotary["factor"])
    if rotary["scaling"] == "llama3":
        parameters.update(low_freq_factor=1.0, high_freq_factor=4.0)
    if rotary["scaling"].startswith("yarn"):
        parameters.update(beta_fast=32.0, beta_slow=1.0)
        parameters["truncate"] = rotary["scaling"] == "yarn"
    return {"rope_parameters": parameters, **out}


def whole_heads(rotary: dict | None, name: str) -> dict | None:
    """``rotary``, for a library whose rotary embeddings turn every channel of a head (Llama's
    ignore a partial_rotary_factor); NotImplementedError (the point is unsupported) where the
    point turns a fraction."""
    if rotary is not None and rotary["fraction"] < 1:
        raise NotImplementedError(
            f"rotary_fraction={rotary['fraction']:g}: {name} turns every channel of a head"
        )
    return rotary


def library_rope(module: str, name: str, config, rotary: dict | None):
    """transformers' ``{name}RotaryEmbedding(config)`` of ``module``, the library's own cos and
    sin, where the point has rotary embeddings (``rotary``); None (the identity) where not."""
    if rotary is None:
        return None
    (Rope,) = library(module, f"{name}RotaryEmbedding")
    return Rope(config)


class Angles:
    """The library's (cos, sin) at positions start .. start + L - 1, made once per start, length,
    dtype and device, outside the timed call (a model makes them once per forward, for all of
    its layers), as the hand-written ways' (variants/rotary.py). ``rope``: the library's module,
    called ``rope(x, position_ids (1, L))``; None: the identity rotation."""

    def __init__(self, rope, head_dim: int):
        self.rope, self.head_dim, self.made = rope, head_dim, {}

    def __call__(self, x: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.rope is None:
            return identity_rotary(x, self.head_dim)
        B, L, _ = x.shape
        key = (start, B, L, x.dtype, x.device)
        if key not in self.made:
            self.rope.to(x.device)
            positions = torch.arange(start, start + L, device=x.device).view(1, L)
            with torch.no_grad():
                cos, sin = self.rope(x, positions)  # (1, L, D) or (1, L, r/2): the library's
            self.made[key] = (cos.expand(B, *cos.shape[1:]), sin.expand(B, *sin.shape[1:]))
        return self.made[key]
