"""Seeded reference module and inputs for one point.

Same seed, same weights, same inputs: everything is drawn on the CPU from a private generator
in float64, then cast and moved, so a point is reproducible across devices and dtypes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from harness.config import Point

# nn.MultiheadAttention zero-initialises both biases; a zero bias hides every bias bug
# (dropped, applied twice, applied to the wrong projection), so they are redrawn at this scale.
BIAS_STD = 0.2


@dataclass
class Inputs:
    query: torch.Tensor  # (B, L, E)
    key: torch.Tensor  # (B, S, E); the very same tensor as query for self-attention
    value: torch.Tensor  # (B, S, E); likewise
    kwargs: dict  # masks and flags for forward(), need_weights=False unless a check asks

    def to(self, device: str, dtype: torch.dtype) -> "Inputs":
        """A copy on device/dtype that keeps query-is-key-is-value identity (nn.MHA's fast path needs it)."""
        query = self.query.to(device, dtype)
        key = query if self.key is self.query else self.key.to(device, dtype)
        value = key if self.value is self.key else self.value.to(device, dtype)
        kwargs = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in self.kwargs.items()}
        return Inputs(query, key, value, kwargs)


def make_reference(point: Point) -> nn.MultiheadAttention:
    """A float64 CPU nn.MultiheadAttention with seeded weights and non-zero biases."""
    gen = torch.Generator().manual_seed(point.seed)
    ref = nn.MultiheadAttention(point.embed_dim, point.num_heads, bias=point.bias, batch_first=True)
    ref = ref.double().eval()
    with torch.no_grad():
        for p in ref.parameters():  # redraw nn.MHA's own init so the weights depend on the seed only
            scale = BIAS_STD if p.dim() == 1 else p.shape[-1] ** -0.5  # weights: unit-variance outputs
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * scale)
    return ref


def make_inputs(point: Point) -> Inputs:
    """Float64 CPU inputs for the point; call ``.to(device, dtype)`` for the point's own."""
    gen = torch.Generator().manual_seed(point.seed + 1)
    B, L, S, E = point.batch, point.seq_len, point.kv_seq_len, point.embed_dim
    query = torch.randn(B, L, E, generator=gen, dtype=torch.float64)
    if point.cross:
        key = torch.randn(B, S, E, generator=gen, dtype=torch.float64)
        value = torch.randn(B, S, E, generator=gen, dtype=torch.float64)
    else:
        key = value = query
    kwargs: dict = {"need_weights": False}
    if point.mask == "causal":
        # nn.MHA wants the explicit mask *and* the hint; True = may not attend. Top-left aligned
        # when S != L, as F.scaled_dot_product_attention(is_causal=True) is.
        kwargs["attn_mask"] = torch.ones(L, S, dtype=torch.bool).triu(1)  # (L, S)
        kwargs["is_causal"] = True
    return Inputs(query, key, value, kwargs)
