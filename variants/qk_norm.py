"""QK-norm as the hand-written ways apply it: q and k RMS-normalised after the projections,
before rotary, with the learned weights ``q_norm`` and ``k_norm`` (loaded from the state dict as
nn.MHA's: harness/features/qk_norm.py, the oracle's, written apart). As transformers' Qwen3RMSNorm:
computed in float32, cast back. ``over``: ``head`` (each head's D channels, a (D,) weight) or
``whole`` (the token's H * D channels, an (H * D,) weight).

Vocabulary: B batch, H heads (or K/V heads), T tokens, D head_dim.
"""

from __future__ import annotations

import torch


def normed(x: torch.Tensor, weight: torch.Tensor, eps: float, over: str) -> torch.Tensor:
    """x (B, H, T, D) RMS-normed and scaled by ``weight``, in x's dtype."""
    dtype = x.dtype
    if over == "whole":
        B, H, T, D = x.shape
        flat = x.transpose(1, 2).reshape(B, T, H * D).float()
        flat = flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + eps)
        return (weight * flat.to(dtype)).view(B, T, H, D).transpose(1, 2)
    y = x.float()
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(dtype)
