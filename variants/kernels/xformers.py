"""xformers' ``memory_efficient_attention`` (the optional xformers package). xformers picks its
own kernel; where none fits (dtype, head size) it says why, condensed here to one line."""

from __future__ import annotations

import functools

import torch

from variants.kernels import Kernel
from variants.masks import Masks


@functools.lru_cache(maxsize=None)
def function():
    from xformers.ops import memory_efficient_attention

    return memory_efficient_attention


def bias_for(mask: torch.Tensor | None, causal: bool, B: int, H: int, L: int, S: int):
    """The ``attn_bias`` for xformers: its ``LowerTriangularMask`` (top-left, like nn.MHA's) for
    causality, the merged additive mask as a dense (B, H, L, S) tensor, or both. xformers wants
    that tensor's rows 16-byte aligned, so it is a slice of a buffer whose last dim is rounded up
    to 8."""
    from xformers.ops import LowerTriangularMask

    bias = None
    if mask is not None:
        buffer = mask.new_zeros(B, H, L, -(-S // 8) * 8)  # (B, H, L, S rounded up to 8)
        bias = buffer[..., :S]  # (B, H, L, S), rows aligned
        bias.copy_(mask.expand(B, H, L, S))
    if causal:
        return LowerTriangularMask() if bias is None else LowerTriangularMask().add_bias(bias)
    return bias


def one_line(exc: NotImplementedError) -> str:
    """xformers' "`op` is not supported because:" lists, one per kernel, as their distinct
    reasons."""
    reasons, listing = [], False
    for line in str(exc).splitlines():
        if line.rstrip().endswith("is not supported because:"):
            listing = True
        elif listing and line.startswith((" ", "\t")) and line.strip() not in reasons:
            reasons.append(line.strip())
        else:
            listing = False
    return "; ".join(reasons)


def attend(q, k, v, m: Masks) -> torch.Tensor:
    """q (B, H, L, D), k/v (B, H, S, D) -> out (B, H, L, D); xformers' layout is (B, T, H, D).
    The dense bias is built once per mask and shape (``Masks.cached``): as costly as attention."""
    bias = m.cached(
        "xformers",
        lambda: bias_for(m.merged(q.dtype, q.device), m.causal, m.B, m.H, m.L, m.S),
        q.dtype,
        str(q.device),
    )
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, D) -> (B, T, H, D), a view
    try:
        return function()(q, k, v, attn_bias=bias).transpose(1, 2)  # (B, L, H, D) -> (B, H, L, D)
    except NotImplementedError as exc:
        raise NotImplementedError(
            "attention=xformers: memory_efficient_attention has no kernel for "
            "this point: " + one_line(exc)
        ) from None


KERNEL = Kernel(
    name="xformers",
    title="xformers' memory-efficient attention",
    fn=attend,
    devices=("cuda",),
    limits={"sinks": (False,)},  # no sink's column in xformers' softmax
    order=30,
    memory="it holds no (L, S) scores (a mask other than causal is a dense (B, H, L, S) bias)",
    package="xformers.ops",
    install="xformers",
    reason="memory_efficient_attention's kernels run on CUDA, and return no log-sum-exp to "
    "rescale for sinks",
    doc="xformers' memory_efficient_attention (optional package; CUDA)",
)
