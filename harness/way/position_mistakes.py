"""The known mistakes of a position bias (issue 59), each nn.MultiheadAttention's math with its
``position`` step done wrong (harness/way/steps.py; the catalogue's other mistakes:
harness/way/mistakes.py, which imports this module). ALiBi's right step adds -slope_h * |i - j|
for query position i and key position j (harness/way/positions.py)."""

from __future__ import annotations

import torch

from harness.config import Point
from harness.way.positions import alibi, alibi_slopes
from harness.way.steps import mistake


def _alibi(p: Point) -> bool:
    return p.position_bias == "alibi"


def _positions(L: int, S: int):
    return torch.arange(S - L, S), torch.arange(S)  # the queries are the last L of S


@mistake(
    "position",
    "ALiBi's slopes in the reverse head order (head 0 given the smallest)",
    "slope_h = 2^(-8(h+1)/H): head 0 has the largest, 1/2 for H=8",
    lambda p: _alibi(p) and p.num_heads > 1,
)
def alibi_slopes_reversed(m, L, S):
    return alibi(alibi_slopes(m.H)[::-1], *_positions(L, S))


@mistake(
    "position",
    "one ALiBi slope for every head (head 0's)",
    "one slope per head, 2^(-8(h+1)/H) for head h (a (H, 1, 1) tensor, not a scalar)",
    lambda p: _alibi(p) and p.num_heads > 1,
)
def alibi_slope_shared(m, L, S):
    return alibi([alibi_slopes(m.H)[0]] * m.H, *_positions(L, S))


@mistake(
    "position",
    "ALiBi's bias added with the wrong sign (+slope * distance: far keys favoured)",
    "add -slope_h * |i - j|: the farther the key, the lower its logit",
    _alibi,
)
def alibi_sign(m, L, S):
    return -alibi(alibi_slopes(m.H), *_positions(L, S))


@mistake(
    "position",
    "ALiBi omitted (no position bias added)",
    "add -slope_h * |i - j| to head h's scores before the softmax",
    _alibi,
)
def alibi_missing(m, L, S):
    return None


@mistake(
    "position",
    "a decode step's query positions counted from 0 (they are P .. P + L - 1, after the cache)",
    "offset the queries by the cache length: i = P + the new token's index",
    lambda p: _alibi(p) and p.kv_cache_len is not None,
)
def alibi_decode_offset(m, L, S):
    return alibi(alibi_slopes(m.H), torch.arange(L), torch.arange(S))


@mistake(
    "position",
    "ALiBi as +slope * j, the key's position only (BLOOM's shortcut, right only under a causal "
    "mask, where the row's -slope * i cancels in the softmax)",
    "-slope_h * |i - j|: keys after the query are as far as keys before it",
    lambda p: _alibi(p) and p.mask in ("none", "padding") and p.kv_cache_len is None,
)
def alibi_key_position_only(m, L, S):
    slopes = torch.tensor(alibi_slopes(m.H), dtype=torch.float64).view(-1, 1, 1)
    return slopes * torch.arange(S, dtype=torch.float64).view(1, 1, S).expand(m.H, L, S)
