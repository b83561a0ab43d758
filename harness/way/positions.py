"""Position biases as nn.MultiheadAttention takes them: the oracle's side (issue 59).

ALiBi (Press et al., 2022; BLOOM, MPT): head h adds -slope_h * |i - j| to the logit of query
position i for key position j. nn.MHA has no position bias of its own, but it adds a float
``attn_mask`` of shape (B*H, L, S) to each batch row's and head's logits, so the bias is
handed to it there (harness/way/handed.py): nn.MHA computes ALiBi exactly, in float64 for the
oracle. A module that applies the point's bias itself says so by its ``position_bias`` attribute
(harness/way/calls.py, ``for_module``); any other is handed the bias as nn.MHA is.

Written apart from variants/positions.py (the hand-written ways' own ALiBi), so that the check
compares two implementations of the slopes and the distance, not one with itself.
Vocabulary: B batch, H heads, L queries, S keys; the queries are the last L of the S positions
(a decode step after S - L cached ones; S = L: a prefill).
"""

from __future__ import annotations

import math

import torch


def alibi_slopes(H: int) -> list[float]:
    """The paper's slopes: for H a power of two, 2^(-8/H), 2^(-16/H), ..., 2^(-8); otherwise
    those of the largest power of two below H, then every other slope of twice that many heads
    (BLOOM's ``build_alibi_tensor``, MPT's ``gen_slopes``)."""
    if H & (H - 1) == 0:
        return [2 ** (-8 * (h + 1) / H) for h in range(H)]
    low = 2 ** math.floor(math.log2(H))
    return alibi_slopes(low) + alibi_slopes(2 * low)[0::2][: H - low]


def alibi(slopes, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """(H, L, S) float64: -slope_h * |i - j| for the queries' positions i (L,) and the keys' j
    (S,); the known mistakes (harness/way/mistakes.py) hand it other slopes or positions."""
    distance = (queries.view(-1, 1) - keys.view(1, -1)).abs().to(torch.float64)  # (L, S)
    return -torch.tensor(slopes, dtype=torch.float64).view(-1, 1, 1) * distance


def bias(kind: str, H: int, L: int, S: int, rows=None) -> torch.Tensor | None:
    """(H, L, S) float64: what each head adds to its logits, the queries the last L of the S
    positions; None for ``none``. ``rows`` (a slice or index tensor of the L queries): those
    queries' rows only (the oracle in query blocks)."""
    if kind == "none":
        return None
    queries = torch.arange(S - L, S)
    return alibi(alibi_slopes(H), queries if rows is None else queries[rows], torch.arange(S))
