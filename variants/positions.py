"""ALiBi as the hand-written ways compute it (issue 59): head h adds -slope_h * |i - j| to the
logit of query position i for key position j. harness/way/positions.py is the oracle's own,
written apart so that the check compares two implementations.

Vocabulary: H heads, L queries, S keys; the queries are the last L of the S positions (a decode
step after S - L cached ones).
"""

from __future__ import annotations

import math

import torch


def alibi_slopes(H: int) -> tuple[float, ...]:
    """Head h's slope: (2^(-8/n))^(h+1) for n = H a power of two; otherwise n the power of two
    below H for its first n heads, and the odd-numbered slopes of 2n heads for the rest."""
    n = 2 ** math.floor(math.log2(H))
    first = [(2 ** (-8 / n)) ** (h + 1) for h in range(n)]
    rest = [(2 ** (-8 / (2 * n))) ** (h + 1) for h in range(0, 2 * (H - n), 2)]
    return tuple(first + rest)


def alibi(slopes: tuple[float, ...], L: int, S: int, device) -> torch.Tensor:
    """(1, H, L, S) float32: -slope_h * |i - j| for query i (at position S - L + i), key j."""
    i = torch.arange(S - L, S, device=device).view(L, 1)
    j = torch.arange(S, device=device).view(1, S)
    distance = (i - j).abs().to(torch.float32)  # (L, S)
    return -torch.tensor(slopes, device=device).view(1, -1, 1, 1) * distance
