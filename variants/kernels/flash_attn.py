"""flash-attn's ``flash_attn_func`` (the optional flash-attn package): CUDA, float16/bfloat16.

It takes no mask tensor, only ``causal=True``, and aligns its causal mask to the bottom right
when L != S (nn.MHA's is top-left): those points are refused with the reason rather than
computed differently.
"""

from __future__ import annotations

import functools

import torch

from variants.kernels import Kernel
from variants.masks import Masks


@functools.lru_cache(maxsize=None)
def function():
    from flash_attn import flash_attn_func

    return flash_attn_func


def attend(q, k, v, m: Masks) -> torch.Tensor:
    """q (B, H, L, D), k/v (B, Hkv, S, D) -> out (B, H, L, D); flash-attn's layout is
    (B, T, H, D)."""
    if m.attn_mask is not None or m.key_padding_mask is not None:
        raise NotImplementedError(
            "attention=flash_attn: flash_attn_func takes no mask tensor (only "
            "causal=True); a padding or explicit mask needs flash_attn_varlen_func"
        )
    if m.causal and m.L != m.S:
        raise NotImplementedError(
            "attention=flash_attn: flash_attn_func aligns its causal mask "
            "bottom-right when L != S; nn.MultiheadAttention's is top-left"
        )
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, D) -> (B, T, H, D), a view
    return function()(q, k, v, causal=m.causal).transpose(1, 2)  # (B, L, H, D) -> (B, H, L, D)


KERNEL = Kernel(
    name="flash_attn",
    title="FlashAttention (flash-attn)",
    fn=attend,
    masks=("none", "causal"),
    limits={"position_bias": ("none",), "sinks": (False,)},  # no slopes, no sink in flash-attn
    gqa=True,  # K/V with fewer heads than Q: flash-attn's MQA/GQA
    dtypes=("float16", "bfloat16"),
    devices=("cuda",),
    order=30,
    memory="it holds no (L, S) scores",
    package="flash_attn",
    install="flash-attn --no-build-isolation",
    reason="flash_attn_func runs on CUDA in float16/bfloat16 and takes no mask tensor (its "
    "alibi_slopes are not wired here yet, and flash_attn_func has no sinks)",
    doc="flash-attn's flash_attn_func (optional package; CUDA, float16/bfloat16)",
)
