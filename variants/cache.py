"""A decode step's KV cache, in the two styles models use (config key ``kv_cache``).

Vocabulary: B batch, Hkv K/V heads, D head_dim, P tokens cached, L new tokens.

- ``static``: one buffer per K and V of (B, Hkv, capacity, D), allocated once; a step writes its
  L new keys and values in place at P and attends to the first P + L (what static-cache
  generation and CUDA-graph decoding use: no allocation per step).
- ``concat``: the cache is the keys and values so far, (B, Hkv, P, D); a step concatenates its
  new ones, allocating and copying all P + L (the simplest code, and what a growing cache does).
- ``paged``: a pool of pages of ``page_size`` tokens, (pages, page_size, Hkv, D), and a page
  table (B, N) listing each sequence's pages in cache order (vLLM's PagedAttention; the harness
  hands a shuffled one: harness/way/pages.py). A step writes its L tokens into their pages and
  gathers the P + L into cache order for the attention kernel (what a kernel that cannot read
  pages itself needs: the gather is the cost of paging here).

``update`` returns the keys and values to attend to and leaves the cache as it was: the harness
times one step at a fixed position, repeated. ``advance`` commits the last update, as a model
does after each step (the harness uses it after filling the cache with the prefix, and between
the two steps it checks). A cache whose ``update`` commits (a library's: ``KVCache``) defines
``rewind`` too, called before every timed call: docs/adding.md, "The KV cache contract".
"""

from __future__ import annotations

import torch


class KVCache:
    """A library's KV cache whose ``update`` commits what it appends (transformers' caches, and
    most libraries'), under the harness's cache contract (docs/adding.md, "The KV cache
    contract"). A subclass wraps the library's cache object as ``cache`` (what the library's
    module is handed) and defines ``update``, ``length`` and ``crop``; ``advance``, ``rewind``
    and ``keys`` follow from them.

    - ``capacity``: the tokens the harness asked room for (P + 3L).
    - ``update(k, v)``: k, v (B, Hkv, L, D) appended; returns what the module attends to.
    - ``length``: the tokens held (an adapter reads the new tokens' positions from it).
    - ``crop(n)``: back to the first ``n`` tokens (``rewind`` calls it).
    - ``keys(L)``: how many keys ``update`` returns after L new tokens: ``length + L``; a cache
      that returns its whole preallocated buffer says ``capacity`` (the mask covers the rest).
    """

    def __init__(self, capacity: int, cache=None):
        self.capacity, self.cache, self.kept = capacity, self if cache is None else cache, 0

    def update(self, k: torch.Tensor, v: torch.Tensor):
        raise NotImplementedError(f"{type(self).__name__}.update(k, v)")

    @property
    def length(self) -> int:
        raise NotImplementedError(f"{type(self).__name__}.length")

    def crop(self, n: int) -> None:
        raise NotImplementedError(f"{type(self).__name__}.crop(n)")

    def keys(self, L: int) -> int:
        return self.length + L

    def advance(self) -> None:
        """What is held stays: the length ``rewind`` returns to."""
        self.kept = self.length

    def rewind(self) -> None:
        """Back to the ``advance``d length, before every timed call."""
        if self.length > self.kept:
            self.crop(self.kept)


class PositionCache(KVCache):
    """A library cache its module writes at positions (torchtune's ``cache_pos``, litgpt's
    ``input_pos``): a preallocated buffer of ``capacity`` tokens every call attends to whole
    (``keys``: the mask hides the slots not written yet). Its length is this object's count:
    ``positions(L)`` the next L positions (L,) for a module that is handed them, ``wrote(L)``
    counts a call's tokens (``DecoderAttention`` does after each call), ``crop(n)`` sets the
    count back, and ``rewind_to(n)`` too where the library keeps a position of its own
    (torchtune's ``cache_pos``). ``cache``: the library's object, what the module is handed
    (None where the module holds its cache itself)."""

    def __init__(self, capacity: int, cache=None, rewind_to=None):
        super().__init__(capacity, cache)
        self.written, self.rewind_to = 0, rewind_to

    @property
    def length(self) -> int:
        return self.written

    def positions(self, L: int, device=None) -> torch.Tensor:
        return torch.arange(self.written, self.written + L, device=device)  # (L,)

    def wrote(self, L: int) -> None:
        self.written += L

    def update(self, k: torch.Tensor, v: torch.Tensor):
        raise NotImplementedError("a PositionCache is written by its module, at its positions")

    def crop(self, n: int) -> None:
        self.written = min(self.written, n)
        if self.rewind_to is not None:
            self.rewind_to(self.written)

    def keys(self, L: int) -> int:
        return self.capacity


class StaticCache:
    def __init__(self, B: int, kv_heads: int, capacity: int, head_dim: int, device, dtype):
        shape = (B, kv_heads, capacity, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)  # (B, Hkv, capacity, D)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.length = 0  # P
        self.pending = 0

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v (B, Hkv, L, D) written at P; returns (B, Hkv, P + L, D) views of the buffers."""
        end = self.length + k.size(2)
        self.k[:, :, self.length : end] = k
        self.v[:, :, self.length : end] = v
        self.pending = end
        return self.k[:, :, :end], self.v[:, :, :end]

    def advance(self) -> None:
        self.length = self.pending


class ConcatCache:
    def __init__(self, B: int, kv_heads: int, capacity: int, head_dim: int, device, dtype):
        shape = (B, kv_heads, 0, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)  # (B, Hkv, P, D)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.pending = (self.k, self.v)

    @property
    def length(self) -> int:
        return self.k.size(2)

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v (B, Hkv, L, D); returns new (B, Hkv, P + L, D) tensors: the cache copied whole."""
        self.pending = (torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2))
        return self.pending

    def advance(self) -> None:
        self.k, self.v = self.pending


class PagedCache:
    def __init__(
        self, B: int, kv_heads: int, capacity: int, head_dim: int, device, dtype,
        page_size: int, page_table: torch.Tensor,
    ):  # fmt: skip
        n = page_table.size(1)  # pages per sequence
        if page_table.size(0) != B or n * page_size < capacity:
            raise ValueError(
                f"page_table {tuple(page_table.shape)} of pages of {page_size} tokens does not "
                f"hold {B} sequences of {capacity} tokens"
            )
        # vLLM's and flash-attn's layout: (pages, page_size, Hkv, D), a page one contiguous block
        shape = (int(page_table.max()) + 1, page_size, kv_heads, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        # Where the pages are gathered into cache order: allocated once, as a serving engine's
        # workspace (a fresh tensor per step would time the allocator's page faults instead).
        self.out_k = torch.empty((B * n, *shape[1:]), device=device, dtype=dtype)
        self.out_v = torch.empty_like(self.out_k)
        self.table, self.page_size = page_table.to(device), page_size
        self.length = 0  # P
        self.pending = 0
        self.slots: dict = {}

    def where(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The pool pages (B, T) and in-page slots (T,) of tokens start .. end - 1 (once each)."""
        if (start, end) not in self.slots:
            t = torch.arange(start, end, device=self.table.device)
            self.slots[start, end] = (self.table[:, t // self.page_size], t % self.page_size)
        return self.slots[start, end]

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v (B, Hkv, L, D) written into their pages at P .. P + L - 1; returns the P + L
        gathered into cache order, (B, Hkv, P + L, D) views of the workspace: whole pages copied,
        as a kernel that cannot read pages needs them."""
        end = self.length + k.size(2)
        page, slot = self.where(self.length, end)  # (B, L), (L,)
        self.k[page, slot] = k.transpose(1, 2)  # pool[(B, L), (L,)] is (B, L, Hkv, D)
        self.v[page, slot] = v.transpose(1, 2)
        self.pending = end
        return self.gathered(self.k, self.out_k, end), self.gathered(self.v, self.out_v, end)

    def gathered(self, pool: torch.Tensor, out: torch.Tensor, end: int) -> torch.Tensor:
        """The first ``end`` tokens of every sequence from ``pool``, in cache order, in ``out``."""
        B = self.table.size(0)
        used = -(-end // self.page_size)  # the pages that hold them
        rows = out.view(-1)[: B * used * out[0].numel()].view(B * used, *out.shape[1:])
        torch.index_select(pool, 0, self.table[:, :used].reshape(-1), out=rows)
        H, D = out.shape[2:]
        return rows.view(B, used * self.page_size, H, D)[:, :end].transpose(1, 2)

    def advance(self) -> None:
        self.length = self.pending


def make_cache(
    style: str, B: int, kv_heads: int, capacity: int, head_dim: int, device, dtype, **paged
):
    """An empty cache of ``style`` for up to ``capacity`` tokens; ``paged``: page_size and
    page_table for style=paged."""
    cls = {"static": StaticCache, "concat": ConcatCache, "paged": PagedCache}[style]
    return cls(B, kv_heads, capacity, head_dim, device, dtype, **paged)
