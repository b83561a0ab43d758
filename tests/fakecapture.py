"""A CUDA graph capture as torch 2.11 does it, without a GPU, for the capture paths
(tests/test_capture.py). Modelled on torch/cuda/graphs.py and c10's capture rules:

- streams: a current stream per process (the default one until ``torch.cuda.stream(s)`` makes
  ``s`` current; its context restores the last one on exit, in ``__exit__``);
- ``CUDAGraph.capture_begin`` on the default stream is refused (capture needs a side stream);
  a capture makes its stream capturing and sends the caching allocator's new blocks to the
  graph's private pool;
- inside a capture, a synchronize (``torch.cuda.synchronize``, ``.item()``, ``torch.all(mask)``
  on the device) is refused with CUDA's error and invalidates the capture;
- ``capture_end`` of an invalidated capture raises CUDA's secondary error; with
  ``stuck=True`` (torch 2.11 seen leaving the allocator capturing) it leaves the stream
  capturing, and a later synchronize aborts the process (here: ``Aborted``);
- ``torch.cuda.graph``'s context: ``__enter__`` synchronizes, empties the cache, makes its
  process-wide capture stream current and begins; ``__exit__`` ends the capture, then restores
  the stream, with no ``finally``.
"""

from __future__ import annotations

import contextlib

REFUSED = "CUDA error: operation not permitted when stream is capturing"
INVALIDATED = "CUDA error: operation failed due to a previous error during capture"


class Aborted(BaseException):
    """What a synchronize does to the process while a capture is left open."""


class FakeCuda:
    def __init__(self, stuck: bool = False, pool_mb: int = 300):
        self.stuck = stuck
        self.pool_mb = pool_mb
        self.default = self.Stream()
        self.current = self.default
        self.capturing = None  # the stream a capture is underway on
        self.invalid = False
        self.reserved_mb = 500  # the caching allocator's reserved memory
        self.captures = 0
        self._graph_stream = None  # torch.cuda.graph's one capture stream per process

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
        self.reserved_mb = 0

    def memory_reserved(self, *a) -> int:
        return self.reserved_mb * 2**20

    # graphs -------------------------------------------------------------------------------
    def CUDAGraph(self):  # noqa: N802
        fake = self

        class CUDAGraph:
            def capture_begin(self, *a, **k):
                if fake.current is fake.default:
                    raise RuntimeError("CUDA graphs must be captured on a non-default stream.")
                if fake.capturing is not None:
                    raise RuntimeError(REFUSED)
                fake.capturing, fake.invalid = fake.current, False

            def capture_end(self):
                invalid, fake.invalid = fake.invalid, False
                if invalid:
                    if not fake.stuck:
                        fake.capturing = None
                    raise RuntimeError(INVALIDATED)
                fake.capturing = None
                fake.captures += 1
                fake.reserved_mb += fake.pool_mb  # the graph's private pool

            def replay(self):
                if fake.capturing is not None:
                    raise Aborted("replay with a capture left open")

        return CUDAGraph()

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
            "CUDAGraph",
            "graph",
        ):
            monkeypatch.setattr(torch_module.cuda, name, getattr(self, name))
