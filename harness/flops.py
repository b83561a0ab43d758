"""Work models of one multi-head attention call, next to the timer: FLOPs (multiply-add = 2
FLOPs) and, for a decode step, the bytes it must move.

    projections  Q and output: 2*B*L*E^2 each      K and V: 2*B*T*E*Ekv each
                 (Ekv = E * Hkv / H, the K/V width; T = S, or L in a decode step: the cached
                 tokens' keys and values are not computed again)
    attention    Q @ K^T and P @ V: 2*B*E each per (query, key) pair a query sees
                 (summed over heads: H * D = E); L*S pairs, causal prefill half of them
                 (flash-attention's convention), decode and sliding windows counted exactly
    backward     2x the projections (grad of input and of weight)
                 2.5x the attention (flash-attention's convention: dQ, dK, dV, dP, and
                 the recomputed scores counted at half)

Grouped K/V heads share their keys and values but every query head still attends, so the
attention term does not shrink. Padding masks do not reduce the count (the work is dense);
softmax, bias and mask additions are O(B*H*L*S) and left out, as flash-attention's benchmarks do.
"""

from __future__ import annotations


def pairs_seen(L: int, S: int, causal: bool, window: int | None = None, cached: int = 0) -> float:
    """(query, key) pairs attended. Without a cache or a window: L*S, half of it causal (the
    convention, whatever L and S). With them the L queries are the last L of the S positions
    (a decode step after ``cached`` = S - L tokens; a window's prefill has L = S), each seeing
    the keys up to itself, the last ``window`` of them with a window: counted."""
    if window is None and not cached:
        return L * S * (0.5 if causal else 1.0)
    return float(sum(min(p + 1, window or p + 1) for p in range(S - L, S)))


def projection_flops(B: int, L: int, T: int, E: int, kv_frac: float = 1.0) -> float:
    return 2 * B * L * E * E * 2 + 2 * B * T * E * E * kv_frac * 2  # (Q, out) + (K, V)


def attention_flops(B: int, pairs: float, E: int) -> float:
    return 4 * B * pairs * E


def mha_flops(
    B: int,
    L: int,
    S: int,
    E: int,
    causal: bool,
    mode: str,
    kv_frac: float = 1.0,
    cached: int = 0,
    window: int | None = None,
) -> float:
    """``kv_frac`` = num_kv_heads / num_heads; ``cached`` = kv_cache_len (its keys and values
    are not projected again)."""
    proj = projection_flops(B, L, S - cached, E, kv_frac)
    attn = attention_flops(B, pairs_seen(L, S, causal, window, cached), E)
    if mode == "fwd":
        return proj + attn
    return proj * (1 + 2) + attn * (1 + 2.5)


def decode_bytes(B: int, L: int, P: int, E: int, kv_frac: float, bias: bool, itemsize: int):
    """Bytes a decode step moves at least: the projection weights read once, the P cached keys
    and values read, the L new ones written (and read), the input read, the output written."""
    Ekv = E * kv_frac
    weights = 2 * E * E + 2 * E * Ekv + (2 * E + 2 * Ekv if bias else 0)  # Q, out; K, V
    cache = 2 * B * (P + L) * Ekv  # keys and values attended (the L new ones included)
    new = 2 * B * L * Ekv  # the new keys and values written
    return itemsize * (weights + cache + new + 2 * B * L * E)


def tflops(flops: float, latency_ms: float) -> float:
    return flops / (latency_ms * 1e-3) / 1e12


def gbps(nbytes: float, latency_ms: float) -> float:
    return nbytes / (latency_ms * 1e-3) / 1e9
