"""nn.MultiheadAttention's mask rules, for the harness (the activation-scale check's logits) and
for every variant and kernel (variants/masks.py re-exports ``merge_masks``).

nn.MHA's conventions: a bool mask's True means "may not attend" (the opposite of SDPA's bool
convention); a float mask is added to the scores; ``attn_mask`` is (L, S) or (B*H, L, S) and
``key_padding_mask`` (B, S). Vocabulary: B batch, H heads, L query length, S key length.
"""

from __future__ import annotations

import torch


def merge_masks(
    attn_mask: torch.Tensor | None,
    key_padding_mask: torch.Tensor | None,
    B: int,
    H: int,
    L: int,
    S: int,
    dtype: torch.dtype,
) -> torch.Tensor | None:
    """One additive float mask broadcastable to (B, H, L, S), with nn.MultiheadAttention's rules.

    nn.MHA converts bool masks to float (True -> -inf) and adds both masks, so do we.
    """
    mask = None
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            attn_mask = torch.zeros_like(attn_mask, dtype=dtype).masked_fill(
                attn_mask, float("-inf")
            )
        attn_mask = attn_mask.to(dtype)
        if attn_mask.dim() == 2:  # (L, S)
            mask = attn_mask.view(1, 1, L, S)
        else:  # (B*H, L, S) -> (B, H, L, S)
            mask = attn_mask.view(B, H, L, S)
    if key_padding_mask is not None:
        if key_padding_mask.dtype == torch.bool:
            key_padding_mask = torch.zeros_like(key_padding_mask, dtype=dtype).masked_fill(
                key_padding_mask, float("-inf")
            )
        kpm = key_padding_mask.to(dtype).view(B, 1, 1, S)  # (B, S) -> (B, 1, 1, S)
        mask = kpm if mask is None else mask + kpm
    return mask
