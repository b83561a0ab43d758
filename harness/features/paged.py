"""A paged KV cache, ``kv_cache=paged page_size=N`` (vLLM's PagedAttention, FlashAttention's
``block_table``): the keys and values in a pool of pages, a sequence's page table listing, in
cache order, the pool pages its tokens are in. A module's ``new_cache`` is handed the harness's
table (``page_table``: the pages scattered over the pool, so that a module that reads them as
contiguous fails, and its mistake is named); nn.MultiheadAttention, the oracle, recomputes the
whole sequence in every call. B batch, T tokens a sequence may hold, N pages per sequence.
"""

from __future__ import annotations

from harness.features import Feature, numeric, torch
from harness.keys import key
from harness.validate import InvalidPoint, count, number

# page_size when kv_cache=paged leaves it null: vLLM's default block size
PAGE_SIZE = 16


def pages(capacity: int, page_size: int) -> int:
    """N, the pages one sequence of ``capacity`` tokens needs."""
    return -(-capacity // page_size)


def page_table(B: int, capacity: int, page_size: int, seed: int):
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


def read_contiguously(table, page_size: int, held: int):
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


class Paged(Feature):
    keys = {
        "page_size": key(
            None,
            "tokens per page with kv_cache=paged (null: 16, vLLM's default); refused with the "
            "other styles",
            role="way",
            after="kv_cache",
        )
    }
    cache_arguments = ("page_size", "page_table")
    examples = (dict(kv_cache_len=9, seq_len=2, kv_cache="paged", page_size=4),)
    values = {
        "kv_cache": {
            "paged": "a pool of pages of page_size tokens and a seeded, shuffled page table per "
            "sequence, the pages gathered into cache order for the attention"
        }
    }

    def active(self, point) -> bool:
        return point.kv_cache == "paged" and point.kv_cache_len is not None

    def check(self, point, set_) -> None:
        if point.kv_cache != "paged":
            if point.page_size is not None:
                raise InvalidPoint(
                    f"page_size={point.page_size!r} applies to kv_cache=paged only "
                    f"(kv_cache={point.kv_cache})"
                )
            return
        set_("page_size", PAGE_SIZE if point.page_size is None else point.page_size)
        number("page_size", point.page_size, 0, above=True, integer=True,
               unit="a positive integer (tokens per page)")  # fmt: skip

    def held(self, point) -> int:
        """The pool: K and V for every page of every sequence, whole pages (B, N * page_size,
        Hkv * D) each: page_size=2147483647 asked the allocator for 512 GiB, unestimated."""
        width = point.embed_dim * point.num_kv_heads // point.num_heads
        tokens = pages(point.cache_capacity, point.page_size) * point.page_size  # per sequence
        return 2 * point.batch * tokens * width

    def cache_kwargs(self, point) -> dict:
        table = page_table(point.batch, point.cache_capacity, point.page_size, point.seed)
        return {"page_size": point.page_size, "page_table": table}  # (B, N)

    def cache(self, row: dict, style: str) -> str:
        size = numeric(row.get("page_size"))  # NaN: none (another style, or an older row)
        if size != size:
            return style
        return f"{style}:{count(size)}" if style else f"page_size={count(size)}"

    def title(self, factor: str, value: str) -> str | None:
        if factor == "kv_cache" and value.startswith("paged:"):
            return f"a paged KV cache ({value.partition(':')[2]}-token pages, gathered per step)"
        return None


FEATURE = Paged()


def _shows(p) -> bool:  # a pool of one page holds it where a contiguous read looks
    return FEATURE.active(p) and p.batch * pages(p.cache_capacity, p.page_size) > 1


@FEATURE.mistake(
    "project",
    "the page table ignored: each sequence's pages read as if contiguous (page n of sequence b "
    "taken from pool page b * N + n), so other sequences' and positions' keys are attended to",
    "read page n of sequence b at page_table[b, n] (gather the pages in the table's order)",
    _shows,
)
def paged_table_ignored(m, query, key, value, w):
    q, k, v = m.right("project")(m, query, key, value, w)
    p, S = m.point, k.size(1)
    table = page_table(p.batch, p.cache_capacity, p.page_size, p.seed)  # (B, N), the one handed
    index = read_contiguously(table, p.page_size, S).to(k.device)  # (B, S)
    width = table.size(1) * p.page_size
    return q, _read(k, index, width), _read(v, index, width)


def _read(x, index, width: int):
    """x (B, S, E), the tokens written so far, as read at ``index`` (B, S): flat indices into
    (B, width) token slots, -1 for a slot that holds none (zeros)."""
    B, S, E = x.shape
    pool = x.new_zeros(B, width, E)
    pool[:, :S] = x
    flat = torch.cat([pool.reshape(B * width, E), x.new_zeros(1, E)])  # the last row: empty
    return flat[torch.where(index < 0, B * width, index)]  # (B, S, E)
