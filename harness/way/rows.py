"""The query rows a check compares: every row, or at long sequences a deterministic sample
(``Rows``, ``compared_rows``), and the calls and tensors as the check sees them then (``masked``,
``compared``); harness/way/calls.py's ``called`` uses them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from harness import features
from harness.config import Point


# The tensors a check compares (``comparable``): a grouped-query model's gradients per group
# (``grouped``), and the query rows compared, every row or at long sequences a sample of them
# (docs/methodology.md, "Checks at long sequences"; config key ``check_sample_rows``). Query rows
# are independent given the keys and values, so the oracle computes the sampled rows only
# (``collect_in_blocks`` with ``sample``) while the module runs on its full inputs; in fwd_bwd
# every call on the full inputs back-propagates a grad_out zero outside the sample
# (``Rows.masked``), so that every gradient sums over the same rows on both sides. The sample,
# deterministic given the point: the first and last rows, the edges of a sliding window (W-1, W)
# and of a causal mask over fewer keys (S-1, S), and one seeded row in each of equal stretches of
# the rest. A decode point and a short sequence compare every row.

# check_sample_rows=null: every row up to this seq_len (the CPU main job's 128 and 1024 stay
# exact), SAMPLE_ROWS rows above it (the GPU main job's 4096, the long and llm prefills' 8192).
SAMPLE_ABOVE = 1024
# Rows compared above it: the oracle's scores for them cost 4·n·S·E FLOP against its key and
# value projections' 4·S·E² (with grad, 3x both), 1/8 of that at E=1024 with n=128; a mistake
# wrong in a fraction f of the rows is missed with probability about (1-f)^n (1% missed at
# f=3.5%). docs/measurements.md, "Checks at GPU sizes".
SAMPLE_ROWS = 128
# The tensors whose query rows are sampled (dim 1 of out, dim -2 of the weights); gradients are
# compared whole.
BY_ROW = ("out", "attn_weights")


@dataclass(frozen=True)
class Rows:
    """The sampled query rows of a point (sorted, distinct) out of ``L``."""

    index: tuple[int, ...]
    L: int

    @property
    def count(self) -> int:
        return len(self.index)

    def tensor(self, device=None) -> torch.Tensor:
        return torch.tensor(self.index, dtype=torch.long, device=device)

    def masked(self, inputs):
        """``inputs`` (``harness.way.inputs.Inputs``) with a grad_out that is zero outside the
        sampled rows; everything else the very same tensors (query-is-key identity kept)."""
        keep = torch.zeros(inputs.grad_out.size(1), dtype=torch.bool)
        keep[list(self.index)] = True
        keep = keep.to(inputs.grad_out.device).view(1, -1, 1)
        grad_out = torch.where(keep, inputs.grad_out, torch.zeros_like(inputs.grad_out))
        return dataclasses.replace(inputs, grad_out=grad_out)

    def restrict(self, tensors: dict) -> dict:
        """The module's tensors as the oracle has them: the sampled rows of ``out`` (B, L, E) and
        ``attn_weights`` (B, [H,] L, S); gradients whole. A tensor without L query rows (a wrong
        shape, a missing tensor) is left as it is: the check says its shape."""
        out = dict(tensors)
        for name in BY_ROW:
            t = tensors.get(name)
            dim = 1 if name == "out" else -2
            if t is None or t.dim() < 3 or t.size(dim) != self.L:
                continue
            out[name] = t.index_select(dim, self.tensor(t.device))
        return out

    def row(self, i: int) -> int:
        """The sequence's row of the i-th compared row."""
        return self.index[i]

    def in_sequence(self, name: str, index: tuple) -> tuple:
        """An index into a restricted tensor (``restrict``) as an index into the whole one."""
        if name not in BY_ROW or not index:
            return index
        dim = 1 if name == "out" else len(index) - 2
        if not 0 <= dim < len(index) or index[dim] >= self.count:
            return index
        return (*index[:dim], self.index[index[dim]], *index[dim + 1 :])


def compared_rows(point: Point) -> Rows | None:
    """The rows a check of ``point`` compares; None: every row (``check_sample_rows``)."""
    L, n = point.seq_len, point.check_sample_rows
    if point.kv_cache_len is not None:  # decode: two steps on a cache, a few new rows
        return None
    if n is None:
        n = SAMPLE_ROWS if L > SAMPLE_ABOVE else 0
    if n == 0 or n >= L:
        return None
    edges = {0, L - 1}
    if point.mask == "sliding" and point.window is not None:  # the window fills at row W-1
        edges |= {point.window - 1, point.window}
    for feature in features.active(point):  # rows where its mistakes show first
        edges |= feature.rows(point)
    S = point.kv_seq_len
    if point.mask == "causal" and S < L:  # top-left: rows from S on see every key
        edges |= {S - 1, S}
    edges = {r for r in edges if 0 <= r < L}
    rest = torch.tensor(sorted(set(range(L)) - edges), dtype=torch.long)
    k = min(max(0, n - len(edges)), len(rest))
    picked: list[int] = []
    if k:  # one row at a seeded place in each of k equal stretches of the other rows
        gen = torch.Generator().manual_seed(point.seed + 3)
        m = len(rest)
        low = torch.arange(k) * m // k
        high = (torch.arange(k) + 1) * m // k
        at = low + (torch.rand(k, generator=gen, dtype=torch.float64) * (high - low)).long()
        picked = rest[at.clamp(max=m - 1)].tolist()
    return Rows(tuple(sorted(edges | set(picked))), L)


def key_of(point: Point):
    """The key of a shape's yardsticks (harness/way/yardsticks.py): the point less its way and
    measurement, at any dtype, and the query rows its check compares."""
    return dataclasses.replace(point, dtype="float32").shape_key(), compared_rows(point)


def column(rows: Rows | None):
    """The row's ``checked_rows``: how many query rows were compared, or ``all``."""
    return "all" if rows is None else rows.count


def masked(point: Point, inputs):
    """``inputs`` as the check's calls on the full inputs get them (``Rows.masked`` where the
    point samples rows in mode=fwd_bwd; else ``inputs`` itself)."""
    rows = compared_rows(point)
    if rows is None or point.mode != "fwd_bwd":
        return inputs
    return rows.masked(inputs)


def compared(point: Point, tensors: dict) -> dict:
    """A module's tensors as the check compares them with the oracle's: the sampled rows of the
    forward tensors (``Rows.restrict``; all of them where the point samples none)."""
    rows = compared_rows(point)
    return tensors if rows is None else rows.restrict(tensors)
