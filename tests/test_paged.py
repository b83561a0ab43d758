"""A paged KV cache (kv_cache=paged, issue 59): the harness hands a module a shuffled page table
(harness/way/pages.py); gathered back into cache order the pages are the contiguous cache, which
nn.MultiheadAttention recomputes whole (the oracle); a module that reads its pages as contiguous
fails its check with the mistake named."""

import pytest
import torch

from harness.api import verify
from harness.config import InvalidPoint
from harness.factory import make_point
from harness.features.paged import page_table, pages, read_contiguously
from variants.cache import PagedCache, StaticCache
from variants.fused import FusedQKVMHA

SHAPE = dict(batch=2, seq_len=2, kv_cache_len=9, embed_dim=48, num_heads=6, num_threads=1)


@pytest.mark.parametrize("B, capacity, page_size", [(2, 15, 16), (3, 40, 8), (1, 9, 1), (2, 7, 3)])
def test_the_page_table_is_a_seeded_shuffle_with_no_page_where_a_contiguous_read_looks(
    B, capacity, page_size
):
    table = page_table(B, capacity, page_size, seed=3)
    n = pages(capacity, page_size)
    assert table.shape == (B, n) and sorted(table.flatten().tolist()) == list(range(B * n))
    if B * n > 1:
        assert (table.flatten() != torch.arange(B * n)).all()
    assert torch.equal(table, page_table(B, capacity, page_size, seed=3))


@pytest.mark.parametrize("page_size, L", [(4, 2), (3, 1), (16, 3), (1, 2)])
def test_the_pages_gathered_in_the_tables_order_are_the_contiguous_cache(page_size, L):
    """What nn.MHA is compared with: the paged cache's keys and values, step after step, equal a
    static cache's exactly; and a contiguous read of the same pool is what ``read_contiguously``
    says it is (the mistake's model, harness/features/paged.py)."""
    torch.manual_seed(0)
    B, H, D, P = 2, 3, 4, 9
    capacity = P + 3 * L
    table = page_table(B, capacity, page_size, seed=1)
    paged = PagedCache(B, H, capacity, D, "cpu", torch.float64, page_size, table)
    static = StaticCache(B, H, capacity, D, "cpu", torch.float64)
    written = []
    for step in (P, L, L):
        k, v = torch.randn(B, H, step, D, dtype=torch.float64), torch.randn(B, H, step, D)
        written.append(k)
        got, want = paged.update(k, v.double()), static.update(k, v.double())
        assert all(torch.equal(g, w) for g, w in zip(got, want))
        paged.advance(), static.advance()
    held = paged.length
    keys = torch.cat(written, dim=2).transpose(1, 2).reshape(B, held, H * D)  # (B, T, H*D)
    index = read_contiguously(table, page_size, held)  # (B, T)
    n = table.size(1)
    for b in range(B):
        for t in range(held):
            page, slot = b * n + t // page_size, t % page_size  # where a contiguous read looks
            stored = paged.k[page, slot].reshape(-1)  # (Hkv, D)
            i = int(index[b, t])
            expected = (
                torch.zeros(H * D)
                if i < 0
                else keys.reshape(-1, H * D)[(i // (n * page_size)) * held + i % (n * page_size)]
            )
            assert torch.equal(stored, expected.double()), (b, t)


@pytest.mark.parametrize(
    "variant, keys",
    [
        ("fused", dict()),
        ("separate", dict(page_size=4, num_kv_heads=2)),
        ("packed", dict(page_size=3, mask="padding", dtype="bfloat16")),
        ("fused", dict(page_size=1, sinks=True, position_bias="alibi", seq_len=1)),
        ("fused", dict(page_size=5, mask="sliding", window=4, need_weights=True)),
    ],
)
def test_the_ways_with_a_paged_cache_compute_what_nn_mha_does(variant, keys):
    row = verify(variant, **{**SHAPE, "kv_cache": "paged", **keys})
    assert row["status"] == "ok" and row["kv_cache"] == "paged", (row["status"], row["error"])


class ContiguousRead(PagedCache):  # writes through the table, reads pool page b * N + n
    def update(self, k, v):
        end = self.length + k.size(2)
        page, slot = self.where(self.length, end)
        self.k[page, slot] = k.transpose(1, 2)  # (B, L, Hkv, D) into their pages
        self.v[page, slot] = v.transpose(1, 2)
        self.pending = end
        B, n = self.table.shape
        t = torch.arange(end)
        page, slot = torch.arange(B).view(B, 1) * n + t // self.page_size, t % self.page_size
        return self.k[page, slot].transpose(1, 2), self.v[page, slot].transpose(1, 2)


class IgnoresTheTable(FusedQKVMHA):
    def new_cache(self, style, batch, capacity, device, dtype, page_size=None, page_table=None):
        H, D = self.num_kv_heads, self.head_dim
        return ContiguousRead(batch, H, capacity, D, device, dtype, page_size, page_table)


@pytest.mark.parametrize(
    "keys", [dict(), dict(page_size=4, num_kv_heads=2), dict(page_size=3, dtype="bfloat16")]
)
def test_a_cache_that_reads_its_pages_as_contiguous_fails_and_the_mistake_is_named(keys):
    row = verify(IgnoresTheTable, **{**SHAPE, "kv_cache": "paged", **keys})
    assert row["status"] == "mismatch", (row["status"], row["error"])
    assert row["diagnosis"] == "paged_table_ignored", row["diagnosis"]


class NoPages(FusedQKVMHA):  # a cache contract without page tables (static and concat only)
    def new_cache(self, style, batch, capacity, device, dtype):
        return super().new_cache(style, batch, capacity, device, dtype)


def test_paged_refused_in_one_line_and_unsupported_where_a_cache_takes_no_page_table():
    with pytest.raises(InvalidPoint, match=r"^page_size=8 applies to kv_cache=paged only "):
        make_point("fused", **SHAPE, page_size=8)
    with pytest.raises(InvalidPoint, match=r"^page_size=0 "):
        make_point("fused", **SHAPE, kv_cache="paged", page_size=0)
    with pytest.raises(InvalidPoint, match=r"^kv_cache=paged applies to decode points only"):
        make_point("fused", kv_cache="paged")
    assert make_point("fused", **SHAPE, kv_cache="paged").page_size == 16
    row = verify(NoPages, **SHAPE, kv_cache="paged")
    assert row["status"] == "unsupported" and "takes no page_size=" in row["error"], row["error"]
    row = verify("reference", **SHAPE, kv_cache="paged")
    assert row["status"] == "unsupported", row["error"]


def test_the_memory_estimate_counts_the_paged_pool():
    """Issue 74: page_size=2147483647 asked the allocator for 512 GiB instead of being refused by
    the estimate (``oom`` before allocating, with the figures)."""
    from harness.way.footprint import estimate

    small = make_point("fused", **SHAPE, kv_cache="paged", page_size=4)
    huge = make_point("fused", **SHAPE, kv_cache="paged", page_size=2147483647)
    pool = 2 * SHAPE["batch"] * 2147483647 * SHAPE["embed_dim"] * 4  # K and V, float32
    assert estimate(huge, False)["cpu"] - estimate(small, False)["cpu"] >= pool * 0.99
