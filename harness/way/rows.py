"""The tensors a check compares (``comparable``): a grouped-query model's gradients per group
(``grouped``), and the query rows compared, every row or at long sequences a sample of them
(docs/methodology.md, "Checks at long sequences"; config key ``check_sample_rows``).

Given the keys and values, query rows are independent: row i of the output (and of the attention
weights) is nn.MHA's function of query row i alone. So the float64 oracle can compute nn.MHA on a
sample of query rows against every key and value (``collect_in_blocks`` with ``sample``) and be
compared with the same rows of the module's output, while the module still runs on its full
inputs (its full output is what is timed and re-checked). In mode=fwd_bwd every call the check
makes on the full inputs (the module, nn.MHA in the point's dtype, the float32 structure check,
the diagnosis's mistakes) back-propagates a grad_out that is zero outside the sampled rows
(``Rows.masked``) and the oracle those rows of it: every parameter, key and value gradient then
sums over the same rows on both sides and is compared whole and exactly, and the query's
gradient, zero outside the sampled rows on both sides (for a correct module), is compared whole
too. The oracle's cost falls from B·H·L·S scores to B·H·n·S; its key and value projections
(every key is needed) are what is left.

The sample, deterministic given the point: the first and last rows; with mask=sliding the first
row whose window is full and the next one (rows W-1 and W); with a causal mask and fewer keys
than queries the rows where the mask stops hiding keys (S-1 and S); the rest one row at a seeded
place in each of equal stretches of the other rows. A decode point (kv_cache_len, two steps on a
KV cache) and a short sequence compare every row.

Vocabulary: B batch, L query rows, S keys, E embed_dim, H heads.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from harness.config import Point

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


def sample(point: Point) -> Rows | None:
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


def column(rows: Rows | None):
    """The row's ``checked_rows``: how many query rows were compared, or ``all``."""
    return "all" if rows is None else rows.count


def masked(point: Point, inputs):
    """``inputs`` as the check's calls on the full inputs get them (``Rows.masked`` where the
    point samples rows in mode=fwd_bwd; else ``inputs`` itself)."""
    rows = sample(point)
    if rows is None or point.mode != "fwd_bwd":
        return inputs
    return rows.masked(inputs)


def compared(point: Point, tensors: dict) -> dict:
    """A module's tensors as the check compares them with the oracle's: the sampled rows of the
    forward tensors (``Rows.restrict``; all of them where the point samples none)."""
    rows = sample(point)
    return tensors if rows is None else rows.restrict(tensors)


def sum_groups(tensors: dict, E: int, H: int, G: int) -> dict:
    """Gradients of a grouped-query model in nn.MHA's layout (G query heads per K/V head).

    As nn.MHA, each K/V head is G copies (harness/way/inputs.py, ``tie_groups``), and each copy gets
    the gradient of its own query head; the grouped module has one parameter for them, whose
    gradient is their sum (mapped back onto the group's first head). Both read the same once the
    K/V rows of ``grad_in_proj_weight`` and ``grad_in_proj_bias`` hold, per group, the group's
    sum on every head: applied to the oracle, nn.MHA and the variant alike."""
    if G == 1:
        return tensors
    out = dict(tensors)
    D = E // H
    for name in ("grad_in_proj_weight", "grad_in_proj_bias"):
        t = tensors.get(name)
        if t is None or t.numel() == 0 or t.size(0) != 3 * E:
            continue
        t = t.clone()
        for part in (t[E : 2 * E], t[2 * E :]):  # K rows, V rows
            heads = part.view(H // G, G, D, *part.shape[1:])  # (Hkv, G, D, ...)
            heads.copy_(heads.sum(dim=1, keepdim=True).expand_as(heads).clone())
        out[name] = t
    return out


def grouped(point: Point, tensors: dict) -> dict:
    """The tensors the check compares: grouped-query gradients per group
    (``sum_groups``); a bias the point's layout leaves out (``bias``: qkv, out) is zero
    in nn.MHA and has no gradient to compare (the module may have no such parameter)."""
    absent = {"grad_in_proj_bias": not point.in_bias, "grad_out_proj.bias": not point.out_bias}
    kept = {k: v for k, v in tensors.items() if not absent.get(k)}
    return sum_groups(kept, point.embed_dim, point.num_heads, point.groups)


def comparable(point: Point, tensors: dict) -> dict:
    """A module's tensors (``collect``'s, as they came) as the check compares them with the
    oracle's: grouped (``grouped``), the sampled rows of the forward tensors (``compared``)."""
    return compared(point, grouped(point, tensors))
