"""The known mistakes of a paged KV cache (kv_cache=paged, issue 59): nn.MultiheadAttention's
math with its ``project`` step's keys and values read as a paged cache done wrong would read
them (harness/way/steps.py; mistakes.py imports this module, which registers these in the
catalogue). The harness hands the module a shuffled page table (harness/way/pages.py); the right
read gathers each sequence's pages in the table's order, which is the whole sequence as nn.MHA
recomputes it."""

from __future__ import annotations

import torch

from harness.config import Point
from harness.way.calls import CACHE_STEPS
from harness.way.pages import page_table, pages, read_contiguously
from harness.way.steps import mistake, project


def _paged(p: Point) -> bool:  # a pool of one page holds it where a contiguous read looks
    if p.kv_cache != "paged" or p.kv_cache_len is None:
        return False
    return p.batch * pages(p.kv_cache_len + CACHE_STEPS * p.seq_len, p.page_size) > 1


@mistake(
    "project",
    "the page table ignored: each sequence's pages read as if contiguous (page n of sequence b "
    "taken from pool page b * N + n), so other sequences' and positions' keys are attended to",
    "read page n of sequence b at page_table[b, n] (gather the pages in the table's order)",
    _paged,
)
def paged_table_ignored(m, query, key, value, w):
    q, k, v = project(m, query, key, value, w)
    p, L, S = m.point, query.size(1), k.size(1)
    capacity = p.kv_cache_len + CACHE_STEPS * L  # as the harness asked the module's cache for
    table = page_table(p.batch, capacity, p.page_size, p.seed)  # (B, N), the one it was handed
    index = read_contiguously(table, p.page_size, S).to(k.device)  # (B, S)
    width = table.size(1) * p.page_size
    return q, _read(k, index, width), _read(v, index, width)


def _read(x: torch.Tensor, index: torch.Tensor, width: int) -> torch.Tensor:
    """x (B, S, E), the tokens written so far, as read at ``index`` (B, S): flat indices into
    (B, width) token slots, -1 for a slot that holds none (zeros)."""
    B, S, E = x.shape
    pool = x.new_zeros(B, width, E)
    pool[:, :S] = x
    flat = torch.cat([pool.reshape(B * width, E), x.new_zeros(1, E)])  # the last row: empty
    return flat[torch.where(index < 0, B * width, index)]  # (B, S, E)
