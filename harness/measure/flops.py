"""FLOP model of one multi-head attention call (multiply-add = 2 FLOPs), next to the timer.

    projections  Q and output: 2*B*L*E^2 each      K and V: 2*B*S*E^2 each
    attention    Q @ K^T and P @ V: 2*B*L*S*E each (summed over heads: H * D = E)
                 causal: half of it (only the lower triangle is useful work)
    backward     2x the projections (grad of input and of weight)
                 2.5x the attention (flash-attention's convention: dQ, dK, dV, dP, and
                 the recomputed scores counted at half)

Padding masks do not reduce the count (the work is dense); softmax, bias and mask additions
are O(B*H*L*S) and left out, as flash-attention's benchmarks do.
"""

from __future__ import annotations


def projection_flops(B: int, L: int, S: int, E: int) -> float:
    return 2 * B * L * E * E * 2 + 2 * B * S * E * E * 2  # (Q, out) + (K, V)


def attention_flops(B: int, L: int, S: int, E: int, causal: bool) -> float:
    return 4 * B * L * S * E * (0.5 if causal else 1.0)


def mha_flops(B: int, L: int, S: int, E: int, causal: bool, mode: str) -> float:
    proj, attn = projection_flops(B, L, S, E), attention_flops(B, L, S, E, causal)
    if mode == "fwd":
        return proj + attn
    return proj * (1 + 2) + attn * (1 + 2.5)


def tflops(flops: float, latency_ms: float) -> float:
    return flops / (latency_ms * 1e-3) / 1e12
