"""A paged KV cache's page table, as the harness hands it to a module (kv_cache=paged, issue 59).

A paged cache (vLLM's PagedAttention, FlashAttention's ``block_table``) keeps the keys and values
in a pool of fixed-size pages; a sequence's page table lists, in cache order, the pool pages its
tokens are in. The harness draws the table: every sequence's pages scattered over the whole pool
in a seeded order, so that a module that reads its pages as if they were contiguous reads other
sequences' and positions' keys, and its check fails (harness/way/page_mistakes.py names it).
nn.MultiheadAttention, the oracle, is the pages gathered back into cache order: the whole
sequence's keys and values, which it recomputes in every call.

Vocabulary: B batch, T tokens a sequence may hold (the cache's capacity), N pages per sequence.
"""

from __future__ import annotations

import torch


def pages(capacity: int, page_size: int) -> int:
    """N, the pages one sequence of ``capacity`` tokens needs."""
    return -(-capacity // page_size)


def page_table(B: int, capacity: int, page_size: int, seed: int) -> torch.Tensor:
    """(B, N) int64: sequence b's n-th page is pool page ``table[b, n]``, of a pool of B * N pages,
    in a seeded order (its own generator: the point's other draws stay as they were). One seeded
    cycle through the pool, so no page is where a contiguous read would look for it (B * N >= 2):
    a module that ignores the table never passes by chance."""
    n = pages(capacity, page_size)
    gen = torch.Generator().manual_seed(seed + 6)
    order = torch.randperm(B * n, generator=gen)
    table = torch.empty(B * n, dtype=torch.int64)
    table[order] = order.roll(-1)  # each page's slot is the next one's in the cycle
    return table.view(B, n)


def read_contiguously(table: torch.Tensor, page_size: int, held: int) -> torch.Tensor:
    """(B, T) int64 for T = ``held`` tokens: where a module that ignores the table reads token t of
    sequence b, as a flat index b' * T' + t' into the (B, T') tokens written through the table
    (T' = N * page_size), or -1 where that pool slot holds no token (zeros). Sequence b's n-th
    page read as pool page b * N + n."""
    B, n = table.shape
    owner = torch.empty(B * n, dtype=torch.int64)  # pool page -> the (b, n) it holds, flat
    owner[table.flatten()] = torch.arange(B * n)
    t = torch.arange(held)
    read = owner[(torch.arange(B).view(B, 1) * n + t.view(1, held) // page_size)]  # (B, T) pages
    b, page = read // n, read % n
    position = page * page_size + t.view(1, held) % page_size  # (B, T): the token it holds
    flat = b * (n * page_size) + position
    return torch.where(position < held, flat, torch.full_like(flat, -1))
