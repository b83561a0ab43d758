"""A CUDA graph capture as torch 2.11 does it, without a GPU, for the capture paths
(tests/test_capture.py). Modelled on torch/cuda/graphs.py and c10's capture rules:

- streams: a current stream per process (the default one until ``torch.cuda.stream(s)`` makes
  ``s`` current; its context restores the last one on exit, in ``__exit__``);
- ``CUDAGraph.capture_begin`` on the default stream is refused (capture needs a side stream);
  a capture makes its stream capturing and sends the caching allocator's new blocks to the
  graph's private pool;
- inside a capture, a synchronize (``torch.cuda.synchronize``, ``.item()``, ``torch.all(mask)``
  on the device) is refused with CUDA's error and invalidates the capture;
- memory: the caching allocator's cached blocks (emptied by ``empty_cache``) and the graphs'
  pools (kept while graphs hold them: a pool is freed when the last graph captured into it dies,
  as the allocator's private pools are); a capture's pool grows by its call's intermediates and
  outputs, and a capture into a pool used before (``capture_begin(pool=...)``, on the stream
  that pool's last capture used) reuses the intermediates and adds only its outputs;
- ``capture_end`` of an invalidated capture raises CUDA's secondary error; with
  ``stuck=True`` (torch 2.11 seen leaving the allocator capturing) it leaves the stream
  capturing, and a later synchronize aborts the process (here: ``Aborted``);
- with ``leaky=True`` (torch < 2.12, before pytorch#180395) a ``capture_end`` that raises skips
  the allocator's ``endAllocateToPool``: it goes on routing to the pool, and a later eager
  allocation fails as out of memory; ``torch._C._cuda_endAllocateToPool`` ends it (and raises
  where nothing routes to that pool, as the allocator's check does);
- ``torch.cuda.graph``'s context: ``__enter__`` synchronizes, empties the cache, makes its
  process-wide capture stream current and begins; ``__exit__`` ends the capture, then restores
  the stream, with no ``finally``.
"""

from __future__ import annotations

import contextlib
import weakref

import torch

REFUSED = "CUDA error: operation not permitted when stream is capturing"
INVALIDATED = "CUDA error: operation failed due to a previous error during capture"
OUT = torch.ones(2, 3)


class Aborted(BaseException):
    """What a synchronize does to the process while a capture is left open."""


class FakeCuda:
    def __init__(
        self, stuck: bool = False, pool_mb: int = 300, out_mb: int = 0, leaky: bool = False
    ):
        self.stuck, self.leaky = stuck, leaky
        self.routing: set = set()  # the pools the allocator believes a capture allocates to
        self.pool_mb, self.out_mb = pool_mb, out_mb  # a call's intermediates, its outputs
        self.default = self.Stream()
        self.current = self.default
        self.capturing = None  # the stream a capture is underway on
        self.invalid = False
        # the caching allocator's free blocks, per stream (a block is reused only on the stream
        # that freed it; empty_cache returns them all)
        self.cached: dict[object, int] = {self.default: 500}
        self.pools: dict[int, int] = {}  # the graphs' pools, MB
        self.pool_stream: dict[int, object] = {}  # the stream each pool's last capture used
        self.graphs: dict[int, int] = {}  # live graphs per pool: at 0 the pool is freed
        self.captures = 0
        self._graph_stream = None  # torch.cuda.graph's one capture stream per process
        self._tokens = 0
        self._pool = None  # the pool of the capture underway

    # streams ------------------------------------------------------------------------------
    def Stream(self):  # noqa: N802 (torch's name)
        class Stream:
            def wait_stream(self, other):
                pass  # ordering only: nothing to model

        return Stream()

    def current_stream(self):
        return self.current

    @contextlib.contextmanager
    def stream(self, s):
        before, self.current = self.current, s
        try:
            yield
        finally:
            self.current = before

    def is_current_stream_capturing(self) -> bool:
        return self.capturing is not None and self.current is self.capturing

    def synchronize(self, *a):
        if self.capturing is not None:
            if self.current is self.capturing and not self.invalid:
                self.invalid = True
                raise RuntimeError(REFUSED)
            raise Aborted("synchronize with a capture left open: the process aborts")

    def empty_cache(self):
        self.cached = {}  # the graphs' pools stay

    @property
    def reserved_mb(self) -> int:
        return sum(self.cached.values()) + sum(self.pools.values())

    def call(self):
        """A call that allocates ``pool_mb`` of intermediates: eagerly, they stay cached on the
        current stream afterwards; inside a capture they go to the graph's pool."""
        if self.capturing is None:
            if self.routing:  # the allocator believes a capture is under way: no block fits
                raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 MiB")
            self.cached[self.current] = max(self.cached.get(self.current, 0), self.pool_mb)
        return OUT, None

    def end_allocate_to_pool(self, index, pool) -> None:
        if pool not in self.routing:
            raise RuntimeError("endAllocatePool: not currently recording to mempool_id")
        self.routing.discard(pool)

    def memory_reserved(self, *a) -> int:
        return self.reserved_mb * 2**20

    def graph_pool_handle(self):
        self._tokens += 1
        return (self._tokens, 0)

    # graphs -------------------------------------------------------------------------------
    def CUDAGraph(self):  # noqa: N802
        fake = self

        class CUDAGraph:
            def capture_begin(self, pool=None, **k):
                if fake.current is fake.default:
                    raise RuntimeError("CUDA graphs must be captured on a non-default stream.")
                if fake.capturing is not None:
                    raise RuntimeError(REFUSED)
                fake.capturing, fake.invalid = fake.current, False
                fake._pool = pool if pool is not None else fake.graph_pool_handle()
                fake.routing.add(fake._pool)

            def capture_end(self):
                invalid, fake.invalid = fake.invalid, False
                if invalid:
                    if not fake.stuck:
                        fake.capturing = None
                    if not fake.leaky:  # the fixed capture_end ends the routing first
                        fake.routing.discard(fake._pool)
                    raise RuntimeError(INVALIDATED)
                pool, stream = fake._pool, fake.capturing
                fake.routing.discard(pool)
                fake.capturing = None
                fake.captures += 1
                had = fake.pools.get(pool)
                reuse = had is not None and fake.pool_stream.get(pool) is stream
                grown = fake.out_mb if reuse else fake.pool_mb + fake.out_mb
                fake.pools[pool] = (had or 0) + grown
                fake.pool_stream[pool] = stream
                fake.graphs[pool] = fake.graphs.get(pool, 0) + 1
                weakref.finalize(self, fake._graph_died, pool)

            def replay(self):
                if fake.capturing is not None:
                    raise Aborted("replay with a capture left open")

        return CUDAGraph()

    def _graph_died(self, pool) -> None:
        self.graphs[pool] -= 1
        if not self.graphs[pool]:  # its last graph: the pool's memory goes
            self.pools.pop(pool, None)
            self.pool_stream.pop(pool, None)

    def graph(self, cuda_graph):
        """``torch.cuda.graph`` as torch 2.11 writes it (no ``finally`` in ``__exit__``)."""
        fake = self

        class Graph:
            def __enter__(self):
                fake.synchronize()
                fake.empty_cache()
                if fake._graph_stream is None:
                    fake._graph_stream = fake.Stream()
                self.stream_ctx = fake.stream(fake._graph_stream)
                self.stream_ctx.__enter__()
                cuda_graph.capture_begin()

            def __exit__(self, *exc):
                cuda_graph.capture_end()
                self.stream_ctx.__exit__(*exc)
                return False

        return Graph()

    def install(self, monkeypatch, torch_module) -> None:
        """Make ``torch_module.cuda`` (the torch a module under test imported) this fake's."""
        for name in (
            "Stream",
            "current_stream",
            "stream",
            "is_current_stream_capturing",
            "synchronize",
            "empty_cache",
            "memory_reserved",
            "graph_pool_handle",
            "CUDAGraph",
            "graph",
        ):
            monkeypatch.setattr(torch_module.cuda, name, getattr(self, name))
        monkeypatch.setattr(torch_module.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(
            torch_module._C, "_cuda_endAllocateToPool", self.end_allocate_to_pool, raising=False
        )
