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
    kwargs: dict  # masks and flags for forward()
    grad_out: torch.Tensor  # (B, L, E): the fixed upstream gradient for mode=fwd_bwd

    def to(self, device: str, dtype: torch.dtype, requires_grad: bool = False) -> "Inputs":
        """A copy on device/dtype that keeps query-is-key-is-value identity (nn.MHA's fast path
        needs it); with ``requires_grad`` the tensors are fresh leaves that collect gradients."""

        def leaf(t: torch.Tensor) -> torch.Tensor:
            return t.detach().to(device, dtype).requires_grad_(requires_grad)

        query = leaf(self.query)
        key = query if self.key is self.query else leaf(self.key)
        value = key if self.value is self.key else leaf(self.value)
        kwargs = {
            k: (
                v.to(device, dtype if v.is_floating_point() else v.dtype)
                if isinstance(v, torch.Tensor)
                else v
            )
            for k, v in self.kwargs.items()
        }
        return Inputs(query, key, value, kwargs, self.grad_out.to(device, dtype))

    def given(self) -> dict[str, torch.Tensor]:
        """Every tensor handed to forward() (inputs and masks) by name, as copies: what a
        drop-in must leave as it found it (``changed``)."""
        tensors = {
            **self.named(),
            **{k: v for k, v in self.kwargs.items() if isinstance(v, torch.Tensor)},
        }
        return {k: v.detach().clone() for k, v in tensors.items()}

    def changed(self, given: dict[str, torch.Tensor]) -> list[str]:
        """Names of the tensors whose values differ from ``given`` (modified in place)."""
        now = {
            **self.named(),
            **{k: v for k, v in self.kwargs.items() if isinstance(v, torch.Tensor)},
        }
        return [k for k, v in given.items() if not torch.equal(now[k].detach(), v)]

    def named(self) -> dict[str, torch.Tensor]:
        """The input tensors by name, each once (self-attention has a single input, ``query``)."""
        out = {"query": self.query}
        if self.key is not self.query:
            out["key"] = self.key
        if self.value is not self.key and self.value is not self.query:
            out["value"] = self.value
        return out


def make_reference(point: Point) -> nn.MultiheadAttention:
    """A float64 CPU nn.MultiheadAttention with seeded weights and non-zero biases."""
    gen = torch.Generator().manual_seed(point.seed)
    ref = nn.MultiheadAttention(point.embed_dim, point.num_heads, bias=point.bias, batch_first=True)
    ref = ref.double().eval()
    with torch.no_grad():
        for (
            p
        ) in ref.parameters():  # redraw nn.MHA's own init so the weights depend on the seed only
            # weights: unit-variance outputs
            scale = BIAS_STD if p.dim() == 1 else p.shape[-1] ** -0.5
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * scale)
    return ref


def padding_mask(B: int, S: int) -> torch.Tensor:
    """(B, S) bool, True = padded: batch row b pads its last 1 + b*S // (2B) keys, never all of
    them (a fully masked row has no softmax: nn.MHA returns NaN there), none when S == 1."""
    mask = torch.zeros(B, S, dtype=torch.bool)
    for b in range(B):
        n_pad = min(S - 1, 1 + b * S // (2 * B))
        if n_pad > 0:
            mask[b, S - n_pad :] = True
    return mask


def _additive(mask: torch.Tensor) -> torch.Tensor:
    return torch.zeros(mask.shape, dtype=torch.float64).masked_fill(mask, float("-inf"))


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
    grad_out = torch.randn(B, L, E, generator=gen, dtype=torch.float64)
    kwargs: dict = {"need_weights": point.need_weights}
    if point.need_weights:
        kwargs["average_attn_weights"] = point.average_attn_weights
    if point.mask == "causal":
        # nn.MHA wants the explicit mask *and* the hint; True = may not attend. Top-left aligned
        # when S != L, as F.scaled_dot_product_attention(is_causal=True) is.
        kwargs["attn_mask"] = torch.ones(L, S, dtype=torch.bool).triu(1)  # (L, S)
        kwargs["is_causal"] = True
    elif point.mask == "padding":
        kwargs["key_padding_mask"] = padding_mask(B, S)  # (B, S)
    if point.mask_format == "additive":
        for k in ("attn_mask", "key_padding_mask"):
            if k in kwargs:
                kwargs[k] = _additive(kwargs[k])
    return Inputs(query, key, value, kwargs, grad_out)
