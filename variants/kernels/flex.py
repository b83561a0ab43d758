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
    recompile limits are raised and reaching one is an error, not eager (variants/compiling.py)."""
    from torch.nn.attention.flex_attention import flex_attention

    from variants.compiling import loud_limits

    loud_limits()
    return torch.compile(flex_attention, dynamic=False)


def flex_masks(attn_mask, key_padding_mask, causal: bool, B: int, H: int, L: int, S: int, device):
    """nn.MHA's masks for FlexAttention: (block_mask, score_mod). Bool masks and causality
    become a block mask; additive float masks become a score_mod that adds them to the scores
    (no block is skipped)."""
    from torch.nn.attention.flex_attention import create_block_mask

    am, kpm = attn_mask, key_padding_mask
    if am is not None and am.dim() == 3:
        am = am.view(B, H, L, S)  # (B*H, L, S) -> (B, H, L, S)
    bools = [m for m in (am, kpm) if m is not None and m.dtype == torch.bool]
    floats = [m for m in (am, kpm) if m is not None and m.dtype != torch.bool]
    block = score_mod = None
    if causal or bools:

        def mask_mod(b, h, q, kv):  # True = may attend (nn.MHA's bool masks: True = may not)
            ok = q >= kv if causal else q == q
            if am is not None and am.dtype == torch.bool:
                ok = ok & ~(am[b, h, q, kv] if am.dim() == 4 else am[q, kv])
            if kpm is not None and kpm.dtype == torch.bool:
                ok = ok & ~kpm[b, kv]
            return ok

        per_head = am is not None and am.dim() == 4
        per_batch = per_head or (kpm is not None and kpm.dtype == torch.bool)
        block = create_block_mask(
            mask_mod, B if per_batch else None, H if per_head else None, L, S, device=device
        )
    if floats:

        def score_mod(score, b, h, q, kv):
            if am is not None and am.dtype != torch.bool:
                score = score + (am[b, h, q, kv] if am.dim() == 4 else am[q, kv])
            if kpm is not None and kpm.dtype != torch.bool:
                score = score + kpm[b, kv]
            return score

    return block, score_mod


# torch's compiled FlexAttention on the CPU returns wrong values (NaN at times) for fewer keys
# than this, with or without a mask or grouped heads (torch 2.13, 2026-11-23: 2 x 4 heads of 16,
# S = 8: max error 0.79 to 2.3 against SDPA; S >= 16: exact).
CPU_MIN_KEYS = 16


def attend(q, k, v, m: Masks) -> torch.Tensor:
    """q (B, H, L, D), k/v (B, Hkv, S, D) -> out (B, H, L, D). The block mask is built once per
    mask and shape (``Masks.cached``): it evaluates the mask over the whole (L, S) grid."""
    if q.device.type == "cpu" and COMPILED and k.size(2) < CPU_MIN_KEYS:
        raise NotImplementedError(
            f"attention=flex: compiled FlexAttention on the CPU computes wrong values with fewer "
            f"than {CPU_MIN_KEYS} keys (this point has {k.size(2)}; torch {torch.__version__})"
        )
    block, score_mod = m.cached(
        "flex",
        lambda: flex_masks(m.attn_mask, m.key_padding_mask, m.causal, m.B, m.H, m.L, m.S, q.device),
        str(q.device),
    )
    gqa = k.size(1) != q.size(1)  # query head h uses K/V head h // G
    return flex_function()(q, k, v, block_mask=block, score_mod=score_mod, enable_gqa=gqa)


KERNEL = Kernel(
    name="flex",
    title="FlexAttention",
    fn=attend,
    gqa=True,
    doc="FlexAttention under torch.compile (block mask for bool masks, score_mod for float)",
)
