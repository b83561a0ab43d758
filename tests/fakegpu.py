"""A GPU and a host on one simulated clock, for the CUDA timing paths without a GPU
(tests/test_cuda_timing.py, tests/test_device_time.py)."""

from __future__ import annotations

from harness.measure import timing


class HostBoundGPU:
    """A GPU and a host on one simulated clock (ms). Python enqueues a call's ``kernels`` kernels
    in ``launch_ms`` of host time; the GPU runs each kernel for its share of ``gpu_ms`` as soon as
    it is launched and the kernels before it are done, so it idles while Python is slower. A CUDA
    graph's replay is one launch of ``replay_host_ms`` for all of them. An event is stamped when
    the GPU reaches it. The L2 flush is GPU work the host queues in
    ``flush_host_ms`` and the GPU runs for ``flush_gpu_ms``: it hides the start of the launches,
    and leaves the L2 cold: the call after it needs ``cold_ms`` more GPU time (its data fetched
    from memory again; 0: a call whose data does not fit in the L2 anyway)."""

    def __init__(
        self,
        launch_ms,
        gpu_ms,
        kernels=10,
        flush_gpu_ms=0.033,
        flush_host_ms=0.004,
        replay_host_ms=0.008,
        cold_ms=0.0,
    ):
        self.host = self.gpu = 0.0
        self.replay_host_ms = replay_host_ms
        self.launch_ms, self.gpu_ms, self.kernels = launch_ms, gpu_ms, kernels
        self.flush_gpu_ms, self.flush_host_ms = flush_gpu_ms, flush_host_ms
        self.cold_ms, self.cold = cold_ms, False

    def _enqueue(self, host_ms, gpu_ms):
        self.host += host_ms
        self.gpu = max(self.gpu, self.host) + gpu_ms

    def _warming(self) -> float:
        """The GPU time the L2 adds to the next kernel: ``cold_ms`` after a flush, then none."""
        extra, self.cold = (self.cold_ms if self.cold else 0.0), False
        return extra

    def call(self):
        for _ in range(self.kernels):
            self._enqueue(
                self.launch_ms / self.kernels, self.gpu_ms / self.kernels + self._warming()
            )

    def zero_(self):  # the flush buffer's zero_()
        self._enqueue(self.flush_host_ms, self.flush_gpu_ms)
        self.cold = True

    def event(self):
        sim = self

        class Event:
            def record(self):
                sim._enqueue(0.002, 0.0)
                self.at = sim.gpu

            def elapsed_time(self, end):
                return end.at - self.at

        return Event()

    def synchronize(self):
        self.host = max(self.host, self.gpu)

    def clock(self):  # s, as time.perf_counter
        return self.host / 1e3

    def sampler(self):
        s = timing._CudaSampler(
            self.call,
            "cuda",
            flush_l2=False,
            event=self.event,
            synchronize=self.synchronize,
            clock=self.clock,
        )
        s.cache = self  # an L2 flush queued before every call, as on a GPU
        return s

    def replay(self):
        """The call captured in a CUDA graph: one launch, then its kernels back to back."""
        self._enqueue(self.replay_host_ms, self.gpu_ms + self._warming())

    def replay_sampler(self):
        s = self.sampler()
        s.fn = self.replay
        return s

    def synchronised_call_ms(self):  # host_ms_per_call: one call, then wait for it
        t0 = self.host
        self.call()
        self.synchronize()
        return self.host - t0
