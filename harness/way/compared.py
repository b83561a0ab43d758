"""What a check compares of a module's tensors (``comparable``): the query rows (every row, or at
long sequences a deterministic sample: ``Rows``, ``compared_rows``), a grouped-query model's
gradients per group (``grouped``), and its parameters' gradients in nn.MHA's names
(``map_grads``). harness/way/calls.py's ``collect`` calls a module and hands its tensors here.

Gradients of a variant's own parameters are mapped back to nn.MHA's names through the
variant's load hooks: the hooks turn nn.MHA's state dict into the variant's layout with plain
tensor ops (chunk, reshape, permute), so running them on tensors that require grad and
back-propagating the variant's parameter gradients through them gives the gradient in nn.MHA's
layout. No per-variant mapping table; a parameter that receives no gradient counts as zero.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn as nn

from harness import features
from harness.config import Point


# The query rows a check compares: every row, or at long sequences a sample of them
# (docs/methodology.md, "Checks at long sequences"; config key ``check_sample_rows``). Query rows
# are independent given the keys and values, so the oracle computes the sampled rows only
# (harness/way/calls.py, ``collect_in_blocks`` with ``sample``) while the module runs on its full
# inputs; in fwd_bwd every call on the full inputs back-propagates a grad_out zero outside the
# sample (``masked``), so that every gradient sums over the same rows on both sides. The sample,
# deterministic given the point: the first and last rows, the rows a model feature names (a
# window's edges, W-1 and W), those of a causal mask over fewer keys (S-1, S), and one seeded row
# in each of equal stretches of the rest. A decode point and a short sequence compare every row.

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

    def row(self, i: int) -> int:
        """The sequence's row of the i-th compared row."""
        return self.index[i]

    def in_sequence(self, name: str, index: tuple) -> tuple:
        """An index into a restricted tensor (harness/way/calls.py, ``compared``) as an index
        into the whole one."""
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


def compared(rows: Rows | None, tensors: dict) -> dict:
    """A module's tensors as the check compares them with the oracle's: the sampled ``rows`` of
    ``out`` (B, L, E) and ``attn_weights`` (B, [H,] L, S), gradients whole (all of them where the
    point samples none). A tensor without L query rows (a wrong shape, a missing tensor) is left
    as it is: the check says its shape."""
    if rows is None:
        return tensors
    out = dict(tensors)
    for name in BY_ROW:
        t = tensors.get(name)
        dim = 1 if name == "out" else -2
        if t is None or t.dim() < 3 or t.size(dim) != rows.L:
            continue
        out[name] = t.index_select(dim, torch.tensor(rows.index, dtype=torch.long, device=t.device))
    return out


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


def comparable(point: Point, rows: Rows | None, tensors: dict) -> dict:
    """A module's tensors (``collect``'s, as they came) as the check compares them with the
    oracle's: grouped (``grouped``), the sampled ``rows`` of the forward tensors (``compared``)."""
    return compared(rows, grouped(point, tensors))


def reference_layout(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (nn.MHA's keys) turned into ``model``'s keys by its load pre-hooks, as
    ``load_state_dict`` would, but differentiably (nothing is copied into the model)."""
    converted = dict(state)
    for name, module in model.named_modules():  # parents first, as load_state_dict recurses
        prefix = f"{name}." if name else ""
        for hook in module._load_state_dict_pre_hooks.values():
            hook(converted, prefix, {}, True, [], [], [])
    return converted


def map_grads(
    model: nn.Module, reference_state: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The model's parameter gradients expressed in nn.MHA's parameter names and shapes."""
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in reference_state.items()}
    converted = reference_layout(model, leaves)
    outputs, grads = [], []
    for name, param in model.named_parameters():
        mapped = converted.get(name)
        if isinstance(mapped, torch.Tensor) and mapped.requires_grad:
            outputs.append(mapped)
            grads.append(param.grad if param.grad is not None else torch.zeros_like(param))
    names = list(leaves)
    found = (
        torch.autograd.grad(outputs, [leaves[n] for n in names], grads, allow_unused=True)
        if outputs
        else [None] * len(names)
    )
    return {
        f"grad_{n}": (g if g is not None else torch.zeros_like(leaves[n])).detach()
        for n, g in zip(names, found)
    }
