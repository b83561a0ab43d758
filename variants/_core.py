"""Pieces every hand-written variant shares: the options, the forward, the head merge.

Kept in one place so that a toggle (``attention=<a kernel of variants/kernels/>``,
``merge=view|reshape``) means exactly the same thing in every structure; the structures differ
only in how they project. Vocabulary: B batch, L query length, S key length, E embed_dim,
H heads, D = E // H.
"""

from __future__ import annotations

import torch

from variants import kernels
from variants.kernels.manual import attend_with_weights
from variants.masks import Masks

MERGES = ("view", "reshape")


def check_options(name: str, embed_dim: int, num_heads: int, attention: str, merge: str) -> None:
    """Raise ValueError naming the bad value; the harness records it as ``invalid``."""
    if num_heads <= 0 or embed_dim <= 0:
        raise ValueError(
            f"{name}: embed_dim={embed_dim} and num_heads={num_heads} must be positive"
        )
    if embed_dim % num_heads:
        raise ValueError(f"{name}: embed_dim={embed_dim} is not divisible by num_heads={num_heads}")
    kernels.get(attention)  # ValueError naming the value when no kernel has that name
    if merge not in MERGES:
        raise ValueError(f"{name}: merge={merge!r} is not one of {'|'.join(MERGES)}")


def merge_heads(out: torch.Tensor, how: str) -> torch.Tensor:
    """(B, H, L, D) -> (B, L, E). ``view`` needs the explicit copy; ``reshape`` copies
    implicitly."""
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
        self.kernel = kernels.get(attention)
        # A missing optional package is `unsupported` before anything runs (with how to install it).
        missing = self.kernel.unavailable()
        if missing:
            raise NotImplementedError(missing)
        # The kernel the harness reports when no SDPA op ran (its sdpa_kernel column).
        self.attention_kernel = self.kernel.name if self.kernel.names_itself else None
        self.batch_first = True  # what callers of nn.MultiheadAttention check for

    @classmethod
    def kernel_supports(cls, options: dict) -> tuple[str, dict, str | None] | None:
        """(kernel name, what it supports, why it cannot run here or None) for a variant with
        these options, None when they name no kernel: harness/capabilities.py applies it before
        the module is built."""
        import inspect

        default = inspect.signature(cls).parameters.get("attention")
        name = options.get("attention", default.default if default is not None else None)
        if not isinstance(name, str):
            return None
        kernel = kernels.get(name)
        return kernel.name, {**kernel.supports(), "reason": kernel.reason}, kernel.unavailable()

    def project(self, query, key, value):  # -> q (B, H, L, D), k (B, H, S, D), v (B, H, S, D)
        raise NotImplementedError

    def cached(self, name: str, masks: tuple, extra: tuple, build):
        """``build()`` once per mask and shape, outside the timed call: a block mask evaluates the
        mask over the whole (L, S) grid, and xformers' dense bias copies it to (B, H, L, S), as
        costly as attention itself. Keyed on the mask tensors themselves (held in the cache, so
        their ids cannot be reused) and their in-place version; the harness passes the same
        masks to every call of a point."""
        key = (tuple((id(m), getattr(m, "_version", None)) for m in masks), extra)
        cache = self.__dict__.setdefault("_mask_cache", {})
        if name not in cache or cache[name][0] != key:
            cache[name] = (key, build(), masks)
        return cache[name][1]

    def split_heads(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # (B, T, E) -> (B, H, T, D)
        return x.view(B, T, self.num_heads, self.head_dim).transpose(1, 2)

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
        masks = Masks(
            None if use_hint else attn_mask,
            key_padding_mask,
            causal=use_hint or (is_causal and attn_mask is None),
            B=B,
            H=self.num_heads,
            L=L,
            S=S,
            cache=self.cached,
        )
        if need_weights:  # no fused kernel returns them: the explicit path, as nn.MHA does
            out, weights = attend_with_weights(q, k, v, masks)  # (B, H, L, D), (B, H, L, S)
        else:
            out, weights = self.kernel.fn(q, k, v, masks), None  # (B, H, L, D)
        out = self.out_proj(merge_heads(out, self.merge))  # (B, L, E)
        return out, pack_weights(weights, average_attn_weights)
