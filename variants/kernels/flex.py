"""FlexAttention, compiled: nn.MHA's bool masks and causality become a block mask (fully masked
blocks are skipped), additive float masks a score_mod. Every new shape, dtype or mask kind is a
compile (seconds on a CPU), recorded in the row's compile_s apart from the timings."""

from __future__ import annotations

import functools

import torch

from variants.kernels import Kernel
from variants.masks import Masks

# False runs FlexAttention eagerly: the same mask semantics without inductor's compile (seconds
# per mask kind on a CPU) and with float64, which inductor's CPU lowering refuses. The contract
# tests use it to check the mask translation exactly; the harness always compiles.
COMPILED = True


def flex_function():
    if COMPILED and not torch.compiler.is_compiling():
        return compiled_flex()
    # Inside a torch.compile of the whole module (compile=default, ...) the outer compile traces
    # flex_attention itself; a compiled function inside it would only be traced through.
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention


@functools.lru_cache(maxsize=None)
def compiled_flex():
    """torch.compile(flex_attention): the fused kernel (eager FlexAttention is a slow reference
    path, with a warning). One static graph per shape, dtype and mask kind, shared by the points
    of a process that have them (the same graph a user compiling for that shape gets); the
    recompile limits are raised and reaching one is an error, not eager
    (harness/way/compiling.py)."""
    from torch.nn.attention.flex_attention import flex_attention

    from harness.way.compiling import loud_limits

    loud_limits()
    return torch.compile(flex_attention, dynamic=False)


def flex_masks(
    attn_mask, key_padding_mask, causal: bool, B: int, H: int, L: int, S: int, device, pad: int = 0,
    slopes: tuple | None = None, sinks: torch.Tensor | None = None,
):  # fmt: skip
    """nn.MHA's masks for FlexAttention: (block_mask, score_mod). Bool masks and causality
    become a block mask; additive float masks become a score_mod that adds them to the scores
    (no block is skipped), and so does ALiBi (``slopes``: -slope_h * |i - j| computed in the
    kernel from the indices, no (L, S) bias held). With ``pad`` keys appended after the S real
    ones (``key_pad``) the masks are padded with "may not attend" and the block mask hides the
    padding. With ``sinks`` (H,), the first padded key (index S, a zero key with a zero value)
    is the sink: every query sees it, and its score (0) becomes s_h, masks and ALiBi aside."""
    from torch.nn.attention.flex_attention import create_block_mask

    am, kpm = attn_mask, key_padding_mask
    if am is not None and am.dim() == 3:
        am = am.view(B, H, L, S)  # (B*H, L, S) -> (B, H, L, S)
    if pad:  # (..., S) -> (..., S + pad): mask_mod and score_mod index every key they see
        am, kpm = (None if m is None else hide_padding(m, pad) for m in (am, kpm))
    bools = [m for m in (am, kpm) if m is not None and m.dtype == torch.bool]
    floats = [m for m in (am, kpm) if m is not None and m.dtype != torch.bool]
    block = score_mod = None
    if causal or bools or pad:

        def mask_mod(b, h, q, kv):  # True = may attend (nn.MHA's bool masks: True = may not)
            ok = q >= kv if causal else q == q
            if pad:
                ok = ok & (kv < S)
            if am is not None and am.dtype == torch.bool:
                ok = ok & ~(am[b, h, q, kv] if am.dim() == 4 else am[q, kv])
            if kpm is not None and kpm.dtype == torch.bool:
                ok = ok & ~kpm[b, kv]
            if sinks is not None:
                ok = ok | (kv == S)
            return ok

        per_head = am is not None and am.dim() == 4
        per_batch = per_head or (kpm is not None and kpm.dtype == torch.bool)
        block = create_block_mask(
            mask_mod, B if per_batch else None, H if per_head else None, L, S + pad, device=device
        )
    slope = None if slopes is None else torch.tensor(slopes, device=device)  # (H,)
    if floats or slope is not None or sinks is not None:

        def score_mod(score, b, h, q, kv):
            given = score
            if am is not None and am.dtype != torch.bool:
                score = score + (am[b, h, q, kv] if am.dim() == 4 else am[q, kv])
            if kpm is not None and kpm.dtype != torch.bool:
                score = score + kpm[b, kv]
            if slope is not None:  # query q sits at position S - L + q
                score = score - slope[h] * (q + (S - L) - kv).abs()
            if sinks is not None:  # the zero key at S: its score 0 becomes the sink's logit
                score = torch.where(kv == S, given + sinks[h], score)
            return score

    return block, score_mod


def hide_padding(mask: torch.Tensor, pad: int) -> torch.Tensor:
    """An nn.MHA mask (..., S) with ``pad`` more keys that may not be attended: True for a bool
    mask, -inf for an additive one."""
    fill = True if mask.dtype == torch.bool else float("-inf")
    return torch.nn.functional.pad(mask, (0, pad), value=fill)


# Inductor's CPU FlexAttention kernel (torch 2.13) computes Q @ K^T with a micro-GEMM over key
# blocks of 16; its kernel for a last block of fewer keys takes a shortcut whenever that count
# is a multiple of the vector width, and then computes and stores a whole 16-key block anyway:
# scores for keys past the end, written past the row into the next row's scores and, from the
# last row, over the softmax's running max and sum. With 8-float vectors (AVX2) every key count
# S = 8 (mod 16) is wrong (max error 0.2 to 20, or NaN): 8, 24, 40, 56, 72, ... (measured
# 2026-11-25 over S = 1..139, L = 1, 2, 4, 8, float32 and bfloat16, masked or not); 16-float
# vectors (AVX-512) never take the shortcut. A decode step's second step (S = P + 2L) and any
# prefill of such a length hit it. Padding the keys to a multiple of 16 (hidden by the block
# mask) leaves no partial block, so no CPU takes the shortcut (docs/architecture.md, Known
# traps).
CPU_KEY_MULTIPLE = 16


def key_pad(q: torch.Tensor, S: int) -> int:
    """How many hidden keys to append to S keys: on the CPU, where inductor compiles the kernel
    (``COMPILED``, or a torch.compile of the whole module), up to a multiple of 16."""
    compiled = COMPILED or torch.compiler.is_compiling()
    return (-S) % CPU_KEY_MULTIPLE if q.device.type == "cpu" and compiled else 0


def attend(q, k, v, m: Masks) -> torch.Tensor:
    """q (B, H, L, D), k/v (B, Hkv, S, D) -> out (B, H, L, D). The block mask is built once per
    mask and shape (``Masks.cached``): it evaluates the mask over the whole (L, S) grid."""
    sink = 0 if m.sinks is None else 1  # the sink's zero key, at index S
    pad = sink + key_pad(q, k.size(2) + sink)
    block, score_mod = m.cached(
        "flex",
        lambda: flex_masks(
            m.attn_mask,
            m.key_padding_mask,
            m.causal,
            m.B,
            m.H,
            m.L,
            m.S,
            q.device,
            pad,
            m.slopes,
            m.sinks,
        ),  # fmt: skip
        str(q.device),
        pad,
    )
    if pad:  # (B, Hkv, S, D) -> (B, Hkv, S + pad, D): the sink's zero key, the rest hidden
        k = torch.nn.functional.pad(k, (0, 0, 0, pad))
        v = torch.nn.functional.pad(v, (0, 0, 0, pad))
    gqa = k.size(1) != q.size(1)  # query head h uses K/V head h // G
    return flex_function()(q, k, v, block_mask=block, score_mod=score_mod, enable_gqa=gqa)


KERNEL = Kernel(
    name="flex",
    title="FlexAttention",
    fn=attend,
    gqa=True,
    order=20,
    memory="compiled, it holds no (L, S) scores",
    doc="FlexAttention under torch.compile (block mask for bool masks, score_mod for float)",
)
