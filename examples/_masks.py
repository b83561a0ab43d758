"""nn.MultiheadAttention's masks turned into the one additive float mask library kernels accept.

Why additive: nn.MHA's bool masks mean True = may NOT attend, F.scaled_dot_product_attention's
(and so timm's, which hands its mask to SDPA) mean True = MAY attend, and BERT's eager kernel
adds whatever it gets to the scores (a bool True becomes +1.0). 0 / -inf means one thing to all.
"""

from __future__ import annotations

import torch


def additive_mask(attn_mask: torch.Tensor | None, key_padding_mask: torch.Tensor | None,
                  B: int, H: int, L: int, S: int, dtype: torch.dtype) -> torch.Tensor | None:
    """attn_mask (L, S) or (B*H, L, S) plus key_padding_mask (B, S), bool or additive, as one
    float mask broadcastable to (B, H, L, S); None when there is no mask."""
    def additive(m: torch.Tensor) -> torch.Tensor:
        if m.dtype == torch.bool:  # nn.MHA: True = may not attend
            return torch.zeros_like(m, dtype=dtype).masked_fill(m, float("-inf"))
        return m.to(dtype)  # already added to the scores by nn.MHA

    mask = None
    if attn_mask is not None:
        if attn_mask.dim() == 2:
            mask = additive(attn_mask).view(1, 1, L, S)  # (L, S) -> (1, 1, L, S)
        else:
            mask = additive(attn_mask).view(B, H, L, S)  # (B*H, L, S) -> (B, H, L, S)
    if key_padding_mask is not None:
        kpm = additive(key_padding_mask).view(B, 1, 1, S)  # (B, S) -> (B, 1, 1, S)
        mask = kpm if mask is None else mask + kpm  # (B, 1|H, L, S)
    return mask
