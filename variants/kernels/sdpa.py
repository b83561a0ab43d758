"""F.scaled_dot_product_attention: PyTorch picks a fused backend (flash, efficient, cudnn) or its
math path; ``sdpa_backend=`` pins one, and the row's sdpa_kernel column says which ran."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from variants.kernels import Kernel
from variants.masks import Masks, top_left


def sdpa_mask(m: Masks, dtype, device) -> torch.Tensor | None:
    """The masks as one additive mask (SDPA's bool convention is the opposite of nn.MHA's), with
    the causal one folded in when there is another: SDPA takes is_causal or a mask, not both."""
    mask = m.merged(dtype, device)
    if m.causal and mask is not None:
        mask = mask.masked_fill(top_left(m.L, m.S, device), float("-inf"))
    return mask


def attend(q, k, v, m: Masks) -> torch.Tensor:
    """q (B, H, L, D), k/v (B, Hkv, S, D) -> out (B, H, L, D)."""
    mask = m.once("sdpa", lambda: sdpa_mask(m, q.dtype, q.device), q.dtype, str(q.device))
    if k.size(1) != q.size(1):  # grouped-query: SDPA pairs query head h with K/V head h // G
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=m.causal and mask is None, enable_gqa=True
        )
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=m.causal and mask is None
    )


def has_enable_gqa() -> bool:
    """torch >= 2.5's SDPA takes enable_gqa; an older one gets the K/V heads repeated."""
    try:
        q = torch.zeros(1, 2, 1, 1)
        F.scaled_dot_product_attention(q, q[:, :1], q[:, :1], enable_gqa=True)
        return True
    except (TypeError, RuntimeError):
        return False


KERNEL = Kernel(
    name="sdpa",
    title="F.scaled_dot_product_attention",
    fn=attend,
    gqa=has_enable_gqa(),
    names_itself=False,
    order=10,
    memory="its fused backends hold no (L, S) scores",
    doc="F.scaled_dot_product_attention (flash, efficient, cudnn or math backend)",
)
