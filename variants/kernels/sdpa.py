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


def sink_base(m: Masks, dtype, device) -> torch.Tensor:
    """(B|1, H|1, L|1, S + 1) additive: the masks with causality folded in, and a column of
    zeros for the sink's key (``with_sinks`` adds the logits there)."""
    mask = sdpa_mask(m, dtype, device)
    if mask is None and m.causal:
        mask = torch.zeros(m.L, m.S, dtype=dtype, device=device)
        mask = mask.masked_fill(top_left(m.L, m.S, device), float("-inf"))
    if mask is None:  # nothing hidden: one row for every query
        mask = torch.zeros(1, m.S, dtype=dtype, device=device)
    mask = mask if mask.dim() == 4 else mask.view(1, 1, *mask.shape[-2:])
    return F.pad(mask, (0, 1))  # (..., S + 1)


def with_sinks(q, k, v, m: Masks) -> torch.Tensor:
    """SDPA with sinks: a zero key and a zero value appended (logit 0, output 0), the sink
    logits s_h in the mask's column for it, so the key weighs as the sink. The mask is rebuilt
    per call from the cached base (the sinks are a parameter, with a gradient)."""
    base = m.once("sdpa_sinks", lambda: sink_base(m, q.dtype, q.device), q.dtype, str(q.device))
    column = F.pad(m.sink_column(q.dtype), (base.size(-1) - 1, 0))  # (1, H, 1, S + 1): 0 .. 0 s_h
    k, v = (F.pad(t, (0, 0, 0, 1)) for t in (k, v))  # (B, Hkv, S + 1, D)
    gqa = {"enable_gqa": True} if k.size(1) != q.size(1) else {}  # a torch without it: never
    return F.scaled_dot_product_attention(q, k, v, attn_mask=base + column, **gqa)


def _cuda(t: torch.Tensor) -> bool:
    return t.is_cuda


def math_only(q, k, v, mask) -> bool:
    """Whether no fused backend takes grouped heads with this mask (torch 2.11 on CUDA: flash
    takes no mask, memory-efficient no grouped heads before pytorch#191085), so that SDPA would
    fall back to its math path silently and hold the (B, H, L, S) scores: 16-24 GiB at 8k
    tokens where the footprint says none. Asked of torch's own backend checks, once per shape
    and dtype (``Masks.once``)."""
    if mask is None or not _cuda(q) or torch.compiler.is_compiling():
        return False  # compiled: inductor picks its own attention kernel
    try:
        params = torch.backends.cuda.SDPAParams(q, k, v, mask, 0.0, False, True)
        fused = (
            torch.backends.cuda.can_use_flash_attention,
            torch.backends.cuda.can_use_efficient_attention,
            torch.backends.cuda.can_use_cudnn_attention,
        )
        return not any(can(params, False) for can in fused)
    except (AttributeError, TypeError, RuntimeError):  # a torch without these checks: as before
        return False


def attend(q, k, v, m: Masks) -> torch.Tensor:
    """q (B, H, L, D), k/v (B, Hkv, S, D) -> out (B, H, L, D)."""
    if m.sinks is not None:
        return with_sinks(q, k, v, m)
    mask = m.once("sdpa", lambda: sdpa_mask(m, q.dtype, q.device), q.dtype, str(q.device))
    if k.size(1) != q.size(1):  # grouped-query: SDPA pairs query head h with K/V head h // G
        fallback = m.once("sdpa_gqa", lambda: math_only(q, k, v, mask), q.dtype, str(q.device))
        if fallback:  # every head's K/V (G x their memory, not the scores): a fused backend runs
            G = q.size(1) // k.size(1)
            k, v = (t.repeat_interleave(G, dim=1) for t in (k, v))
        else:
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
