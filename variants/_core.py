"""Pieces every hand-written variant shares: mask merging, the attention kernel, the head merge.

Kept in one place so that a toggle (``attention=manual|sdpa``, ``merge=view|reshape``) means
exactly the same thing in every structure; the structures differ only in how they project.
Vocabulary: B batch, L query length, S key length, E embed_dim, H heads, D = E // H.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

ATTENTION_KERNELS = ("manual", "sdpa")
MERGES = ("view", "reshape")


def check_options(name: str, embed_dim: int, num_heads: int, attention: str, merge: str) -> None:
    """Raise ValueError naming the bad value; the harness records it as ``invalid``."""
    if num_heads <= 0 or embed_dim <= 0:
        raise ValueError(f"{name}: embed_dim={embed_dim} and num_heads={num_heads} must be positive")
    if embed_dim % num_heads:
        raise ValueError(f"{name}: embed_dim={embed_dim} is not divisible by num_heads={num_heads}")
    if attention not in ATTENTION_KERNELS:
        raise ValueError(f"{name}: attention={attention!r} is not one of {'|'.join(ATTENTION_KERNELS)}")
    if merge not in MERGES:
        raise ValueError(f"{name}: merge={merge!r} is not one of {'|'.join(MERGES)}")


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

    Bool masks mean True = "may not attend" (the opposite of SDPA's bool convention), float
    masks are added to the scores. nn.MHA converts both to float and adds them, so do we.
    """
    mask = None
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            attn_mask = torch.zeros_like(attn_mask, dtype=dtype).masked_fill(attn_mask, float("-inf"))
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


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    is_causal: bool,
    kernel: str,
    need_weights: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scaled dot-product attention over heads. q: (B, H, L, D), k/v: (B, H, S, D).

    Returns out (B, H, L, D) and, when asked, the per-head weights (B, H, L, S).
    ``is_causal`` is only a fast-path hint when ``mask`` is None (the variant decides).
    """
    if kernel == "sdpa" and not need_weights:
        # SDPA never returns weights; like nn.MHA we fall back to the explicit path for them.
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal), None
    L, S = q.size(-2), k.size(-2)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))  # (B, H, L, S)
    if is_causal and mask is None:
        causal = torch.ones(L, S, dtype=torch.bool, device=q.device).triu(1)  # (L, S)
        scores = scores.masked_fill(causal, float("-inf"))
    if mask is not None:
        scores = scores + mask
    weights = torch.softmax(scores, dim=-1)  # (B, H, L, S)
    return weights @ v, (weights if need_weights else None)  # (B, H, L, D)


def merge_heads(out: torch.Tensor, how: str) -> torch.Tensor:
    """(B, H, L, D) -> (B, L, E). ``view`` needs the explicit copy; ``reshape`` copies implicitly."""
    B, H, L, D = out.shape
    out = out.transpose(1, 2)  # (B, L, H, D), no longer contiguous
    if how == "view":
        return out.contiguous().view(B, L, H * D)  # (B, L, E)
    return out.reshape(B, L, H * D)  # (B, L, E)


def pack_weights(
    attn_weights: torch.Tensor | None, average_attn_weights: bool
) -> torch.Tensor | None:
    """nn.MHA returns weights averaged over heads (B, L, S) unless asked for (B, H, L, S)."""
    if attn_weights is None:
        return None
    return attn_weights.mean(dim=1) if average_attn_weights else attn_weights


def split_in_proj(state_dict: dict, prefix: str) -> tuple[list, list | None]:
    """nn.MHA's [Wq; Wk; Wv] (3E, E) and [bq; bk; bv] (3E,) popped from a state dict, per part."""
    w = state_dict.pop(prefix + "in_proj_weight")
    b = state_dict.pop(prefix + "in_proj_bias", None)
    return list(w.chunk(3, dim=0)), (list(b.chunk(3, dim=0)) if b is not None else None)


class HandWrittenMHA(torch.nn.Module):
    """The forward that every hand-written structure shares; subclasses only say how to project.

    Subclasses set ``self.out_proj`` (nn.Linear(E, E)) and implement ``project``.
    """

    def __init__(self, embed_dim: int, num_heads: int, bias: bool, attention: str, merge: str):
        super().__init__()
        check_options(type(self).__name__, embed_dim, num_heads, attention, merge)
        self.embed_dim, self.num_heads, self.head_dim = embed_dim, num_heads, embed_dim // num_heads
        self.attention, self.merge = attention, merge
        self.batch_first = True  # what callers of nn.MultiheadAttention check for

    def project(self, query, key, value):  # -> q (B, H, L, D), k (B, H, S, D), v (B, H, S, D)
        raise NotImplementedError

    def split_heads(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        return x.view(B, T, self.num_heads, self.head_dim).transpose(1, 2)  # (B, T, E) -> (B, H, T, D)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = False,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        B, L, _ = query.shape
        S = key.size(1)
        q, k, v = self.project(query, key, value)  # (B, H, L, D), (B, H, S, D), (B, H, S, D)
        # Like nn.MHA: trust the is_causal hint (drop the explicit mask) only when nothing else
        # has to be merged in and no weights are wanted; otherwise apply the mask as given.
        use_hint = is_causal and key_padding_mask is None and not need_weights
        mask = None if use_hint else merge_masks(attn_mask, key_padding_mask, B, self.num_heads, L, S, q.dtype)
        out, weights = attend(q, k, v, mask, use_hint or (is_causal and attn_mask is None),
                              self.attention, need_weights)  # (B, H, L, D)
        out = self.out_proj(merge_heads(out, self.merge))  # (B, L, E)
        return out, pack_weights(weights, average_attn_weights)
