"""What nn.MultiheadAttention is handed in its float ``attn_mask`` for what it has no argument
for: a model feature's term (harness/features/: ALiBi's bias, say). nn.MHA adds a
(B*H, L, S) float mask to each batch row's and head's logits, so any additive term per head is
exact there. Vocabulary: B batch, H heads, L queries, S keys.
"""

from __future__ import annotations

import math

import torch


def additive(mask: torch.Tensor | None, dtype=torch.float64) -> torch.Tensor | None:
    """nn.MHA's mask as an additive float: bool True (may not attend) -> -inf (the one place:
    the oracle's inputs, nn.MHA's math in steps, what nn.MHA is handed)."""
    if mask is None or mask.dtype != torch.bool:
        return None if mask is None else mask.to(dtype)
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask, -math.inf)


def handed(
    kwargs: dict, added: torch.Tensor, B: int, H: int, L: int, S: int, dtype, device
) -> dict:
    """nn.MHA's call ``kwargs`` with ``added`` (broadcastable to (H, L, S)) in its ``attn_mask``:
    (B*H, L, S) float, the given mask (bool: -inf where it may not attend; (L, S) or
    (B*H, L, S)) plus ``added``; ``key_padding_mask`` additive too (nn.MHA wants both of one
    type); no ``is_causal`` hint (it would let nn.MHA drop the mask for its own causal one).
    Differentiable in ``added`` (a sink's gradient flows back through it)."""
    out = {k: v for k, v in kwargs.items() if k != "is_causal"}
    mask = added.to(device, dtype).expand(B, H, L, S)  # (B, H, L, S)
    given = additive(kwargs.get("attn_mask"), dtype)
    if given is not None:
        mask = mask + (given.view(B, H, L, S) if given.dim() == 3 else given)
    out["attn_mask"] = mask.reshape(B * H, L, S)
    if kwargs.get("key_padding_mask") is not None:
        out["key_padding_mask"] = additive(kwargs["key_padding_mask"], dtype)
    return out
