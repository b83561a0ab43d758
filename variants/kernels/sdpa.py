"""F.scaled_dot_product_attention: PyTorch picks a fused backend (flash, efficient, cudnn) or its
math path; ``sdpa_backend=`` pins one, and the row's sdpa_kernel column says which ran."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from variants.kernels import Kernel
from variants.masks import Masks


def attend(q, k, v, m: Masks) -> torch.Tensor:
    """q (B, H, L, D), k/v (B, H, S, D) -> out (B, H, L, D)."""
    mask = m.merged(q.dtype)  # additive: SDPA's bool convention is the opposite of nn.MHA's
    if m.causal and mask is not None:  # SDPA takes is_causal or a mask, not both
        top_left = torch.ones(m.L, m.S, dtype=torch.bool, device=q.device).triu(1)  # (L, S)
        mask = mask.masked_fill(top_left, float("-inf"))
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=m.causal and mask is None
    )


KERNEL = Kernel(
    name="sdpa",
    fn=attend,
    names_itself=False,
    doc="F.scaled_dot_product_attention (flash, efficient, cudnn or math backend)",
)
