"""Time a zero-argument callable: the samplers, one repetition of a round, and a one-window timer.

Points are timed in rounds (``harness/measure/rounds.py``): each round is a short repetition whose
value is the median of its calls (``repetition``). ``measure`` is the one-window timer, kept
for the matmul peak and for scripts that compare timers: warm-up by time, then samples until
the estimate is quiet.

Set everything up first, then hand ``measure`` a ``lambda: model(q, k, v, ...)``: nothing but
the call sits in the timed region. On CUDA each sample is a pair of CUDA events around the call
(device time), after an L2 flush that runs outside the events (a zeroed buffer of 256 MiB, as
triton's do_bench zeroes, or twice the L2 where larger); the calls of a batch are queued back
to back with one synchronize at its end, so that the GPU does not wait for Python's launch of
each where the GPU is the bottleneck (``_CudaSampler`` says how a launch-bound call shows).
A point's rounds time the call replayed from a CUDA graph (``cuda_graph``: the device time, no
launch gaps) and the eager call beside it (harness/measure/session.py). On CPU each sample is
``time.perf_counter`` around it.

Stopping for ``measure`` (nvbench's rule): keep sampling until at least ``min_samples`` and
``min_time`` are in and the relative noise of the median is under ``max_noise``, or until
``max_time`` is spent
(``min_samples`` are taken whatever the time). Noise is the standard error of the median
relative to the median, 1.2533 * sigma / sqrt(n) / median, with sigma estimated robustly as
IQR / 1.349 so that a few preempted samples do not dominate it.
"""

from __future__ import annotations

import contextlib
import gc
import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

# measure() in one window (the matmul peak, validate_timer): stop sampling once the median is
# this steady, by device, unless the Window asks otherwise. Not the sweep's timing.max_noise.
WINDOW_NOISE = {"cuda": 0.005, "cpu": 0.02}
NOISE_CHECK_EVERY = 8  # samples between noise checks (each check sorts the samples)


@dataclass(frozen=True)
class Window:
    """``measure``'s stopping rule (a point's own timing is ``harness.config.Timing``)."""

    warmup: float = 0.05  # s: run the callable at least this long before sampling
    min_samples: int = 10
    max_samples: int = 1000
    min_time: float = 0.5  # s: sample at least this long before the noise may stop it
    max_time: float = 2.0  # s: stop sampling once this much time is spent (after min_samples)
    max_noise: float | None = None  # relative noise of the median to stop at; None: by device
    flush_l2: bool = True  # CUDA: flush L2 between samples
    cuda_graph: bool = False  # CUDA: replay the call from a CUDA graph


@dataclass(frozen=True)
class TimingResult:
    median_ms: float
    iqr_ms: float  # interquartile range (p75 - p25)
    p10_ms: float
    p90_ms: float
    n_samples: int
    noise: float  # relative standard error of the median (see module doc)
    max_noise: float  # the target that applied
    window_s: float  # wall time of the whole measurement (warm-up + sampling)
    launch_ms: float | None = None  # CUDA: host time to enqueue one call (_CudaSampler.launch_ms)

    @property
    def noise_target_met(self) -> bool:
        return self.noise <= self.max_noise


def quantiles(samples: list[float]) -> list[float]:
    """p10, p25, p50, p75, p90 (linear interpolation, like numpy's default)."""
    s = sorted(samples)
    n = len(s)

    def q(p: float) -> float:
        x = p * (n - 1)
        lo = math.floor(x)
        hi = min(lo + 1, n - 1)
        return s[lo] + (s[hi] - s[lo]) * (x - lo)

    return [q(p) for p in (0.10, 0.25, 0.50, 0.75, 0.90)]


def relative_noise(samples: list[float]) -> float:
    if len(samples) < 2:
        return math.inf
    _, q1, med, q3, _ = quantiles(samples)
    if med <= 0:
        return math.inf
    sigma = (q3 - q1) / 1.349
    return 1.2533 * sigma / math.sqrt(len(samples)) / med


FLUSH_MIN = 256 * 2**20  # triton's do_bench zeroes 256 MB before every call


def flush_bytes(device: str) -> int:
    """Size of the buffer zeroed to evict L2: do_bench's 256 MiB, or twice the L2 where that is
    larger. The same size as do_bench's matters beyond eviction: the GPU's time zeroing it
    overlaps the next call's first launches (scripts/validate_timer.py compares the two)."""
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 0
    return max(2 * l2, FLUSH_MIN)


_FLUSH: dict = {}


def flush_buffer(device: str) -> torch.Tensor:
    """One L2-flush buffer per device and process, shared by every point's sampler: a buffer per
    waiting point (100 MB each then, on an H100) added up to 10 GB over a 96-point sweep that the
    memory budget did not see. ``harness.measure.rounds.budget_bytes`` counts this one."""
    index = torch.device(device).index
    key = torch.cuda.current_device() if index is None else index
    if key not in _FLUSH:
        _FLUSH[key] = torch.empty(flush_bytes(device), dtype=torch.int8, device=device)
    return _FLUSH[key]


# Calls at the start of a batch whose enqueue time is read (``_CudaSampler.launch_ms``, the least
# of them): later calls of a GPU-bound batch block once CUDA's launch queue is full, and their
# enqueue time is then the GPU's pace, not Python's. The least, not the median: on an H100 the
# first enqueue after a synchronize took 0.25-0.5 ms against a steady 0.11-0.15 ms (fused SDPA,
# docs/measurements.md), and anything that blocks a launch only adds time.
LAUNCH_CALLS = 4


class _CudaSampler:
    """Device time per call, as triton's ``do_bench`` measures it: a batch of calls is queued back
    to back, each between its own pair of CUDA events (the L2 flush and ``before`` outside
    them), with one synchronize per batch. The GPU then runs the calls without waiting for Python
    between them, so the launch cost is hidden wherever the GPU is the bottleneck; synchronising
    after every call would start each on an idle GPU and put the Python launch of every kernel
    inside the events.

    Where Python enqueues a call more slowly than the GPU runs it, the GPU idles between the
    call's kernels and those gaps fall inside the events: the device time is then mostly host
    time: that is the eager call time, and a CUDA graph's replay (one launch for every kernel)
    is how the rounds read the device time beside it (``schema.LAUNCH_BOUND`` compares the two).
    ``launch_ms`` is the least enqueue time of the first calls of the last batch: why an eager
    call is slow. ``event``, ``synchronize`` and ``clock`` are CUDA's and the host's (a test
    passes a fake GPU that waits for the host)."""

    def __init__(
        self,
        fn: Callable[[], object],
        device: str,
        flush_l2: bool,
        event=None,
        synchronize=None,
        clock=None,
    ):
        self.fn = fn
        self.event = event or (lambda: torch.cuda.Event(enable_timing=True))
        self.synchronize = synchronize or torch.cuda.synchronize
        self.clock = clock or time.perf_counter
        self.pairs: list = []  # (start, end) events, reused from batch to batch
        self.cache = flush_buffer(device) if flush_l2 else None
        self.launch_ms: float | None = None
        # Called once the batch is queued, before its synchronize, while the GPU still runs it:
        # the rounds read NVML's clocks there (harness/measure/clocks.py).
        self.during: Callable[[], object] | None = None

    def batch(self, calls: int, before: Callable[[], object] | None = None) -> list[float]:
        """``calls`` calls, queued; their device times in ms, read after one synchronize."""
        while len(self.pairs) < calls:
            self.pairs.append((self.event(), self.event()))
        pairs = self.pairs[:calls]
        launches = []
        for start, end in pairs:
            if before:
                before()
            if self.cache is not None:
                self.cache.zero_()  # evict L2; queued before `start`, so not timed
            t0 = self.clock()
            start.record()
            self.fn()
            end.record()
            if len(launches) < LAUNCH_CALLS:
                launches.append((self.clock() - t0) * 1e3)
        if self.during is not None:
            self.during()
        self.synchronize()
        self.launch_ms = min(launches) if launches else None
        return [start.elapsed_time(end) for start, end in pairs]

    def __call__(self) -> float:
        return self.batch(1)[0]


class _CpuSampler:
    """Wall time per call: on the CPU the caller waits for every call anyway. Beside it, each
    call's CPU time on the calling thread (``cpu_times``, ms): with one thread that is what the
    way costs, without the time the scheduler gave other processes (``Session.timed_by`` "cpu";
    docs/methodology.md, "How a point is timed"); the CPU time the process's other threads used
    during the batch (``others_ms``): where they worked, the thread's time is not the call's
    whole cost; and the share of the calls' time off the CPU without waiting for one
    (``blocked``). The CPU clock is read outside the wall clock's window."""

    def __init__(self, fn: Callable[[], object]):
        self.fn = fn
        self.cpu_times: list[float] = []
        self.others_ms = 0.0
        self.blocked = 0.0  # share of the calls' wall time neither on a CPU nor waiting for one

    def batch(self, calls: int, before: Callable[[], object] | None = None) -> list[float]:
        times, cpu = [], []
        wait0 = thread_wait()
        thread0, process0 = time.thread_time_ns(), time.process_time_ns()
        for _ in range(calls):
            if before:
                before()
            c0 = time.thread_time_ns()
            t0 = time.perf_counter()
            self.fn()
            t1 = time.perf_counter()
            cpu.append((time.thread_time_ns() - c0) / 1e6)
            times.append((t1 - t0) * 1e3)
        thread, process = time.thread_time_ns() - thread0, time.process_time_ns() - process0
        self.cpu_times, self.others_ms = cpu, max(0.0, (process - thread) / 1e6)
        # a call that sleeps, reads, takes a lock or waits on another process is off the CPU
        # without waiting for one: its CPU time would read it fast (wall time - CPU time - the
        # thread's run-queue wait; unknown without schedstat: 0)
        wait1, wall = thread_wait(), sum(times)
        waited = (wait1 - wait0) * 1e3 if wait0 is not None and wait1 is not None else wall
        self.blocked = max(0.0, wall - sum(cpu) - waited) / wall if wall > 0 else 0.0
        return times

    def __call__(self) -> float:
        return self.batch(1)[0]


def thread_wait() -> float | None:
    """Seconds the calling thread has waited on a run queue (schedstat's run_delay); None where
    the kernel does not keep it."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


# A share of the calls' wall time off the CPU, not waiting for one, past which the CPU clock does
# not time them (they sleep, read or wait on another process): the wall clock does. A quarter, not
# less: the hypervisor's steal is off the CPU too (left out of the thread's time, in no run
# queue), and on this VM a burst of it took a tenth of a short batch now and then.
BLOCKED = 0.25


def cpu_figures(sample, warm: bool) -> tuple[float | None, float]:
    """After a repetition: the median of its timed calls' CPU time on the calling thread (None:
    the sampler keeps none, CUDA), and the CPU ms the process's other threads used meanwhile."""
    times = getattr(sample, "cpu_times", None)
    if not times or len(times) <= warm:
        return None, 0.0
    return statistics.median(times[int(warm) :]), getattr(sample, "others_ms", 0.0)


class CaptureLeftOpen(RuntimeError):
    """A capture that failed and could not be ended: the stream is still capturing, and the
    allocator with it, so that a later synchronize can abort the process. The worker is replaced
    (harness/measure/session.py raises ``BrokenDevice``); nothing more should run in it."""


class GraphMemory:
    """Where the CUDA graphs of the points that wait together for their rounds (a block) keep
    their memory: one pool and one capture stream per device, shared by the block's graphs.

    A graph's private pool holds every tensor its call allocates, so that points with a pool
    each add up to the sum of their calls' peaks (measured on an H200: at B=8, L=4096, causal,
    nn.MultiheadAttention's graph held 38 GB; a shape's twenty ways would not fit an H100).
    Graphs in one pool reuse each other's intermediates: the block holds about its largest call
    plus every graph's outputs. That is safe here because the block's graphs never read each
    other's memory and run one at a time: a replay may overwrite what another graph's last
    replay left in its intermediates, never its live outputs (the allocator keeps them), and the
    re-check reads a graph's output right after its own replay (harness/way/recheck.py). The
    stream is shared too: the allocator reuses a block only on the stream that freed it
    (torch.cuda.graph's note on sharing a pool)."""

    # One capture stream per device for the process, not per block: each new stream got a
    # cuBLAS workspace of its own that no block's count held, block after block.
    streams: dict[str, torch.cuda.Stream] = {}

    def __init__(self):
        self.pools: dict[str, tuple] = {}
        # a capture failed into this block's pool: on a torch without pytorch#190348 the pool's
        # use count stays raised, so it is never freed; the worker is replaced after the block
        self.failed: str | None = None

    def stream(self, device: str):
        if device not in GraphMemory.streams:
            GraphMemory.streams[device] = torch.cuda.Stream()
        return GraphMemory.streams[device]

    def pool(self, device: str):
        if device not in self.pools:
            self.pools[device] = torch.cuda.graph_pool_handle()
        return self.pools[device]


def cuda_graph(
    fn: Callable[[], object],
    before: Callable[[], object] | None = None,
    memory: GraphMemory | None = None,
    device: str = "cuda",
) -> Callable[[], object]:
    """Capture ``fn`` (already warmed up) in a CUDA graph; return its replay, which returns what
    the captured call returned: the graph's own output tensors, rewritten by every replay (the
    re-check reads them: what was timed is what is re-checked). ``before`` (a rewind, clearing
    gradients) runs before each warm-up call and before the capture, so that the graph captures
    the call the check saw, not a later one (a KV cache appended to three times). ``memory``:
    the block's pool and stream on ``device`` (``GraphMemory``; None: a pool of its own).
    ``replay.nbytes``: what the capture added to the device's reserved memory, measured after
    the warm-up's cached blocks are released (as torch.cuda.graph empties the cache first), so
    that it is the graph's pool alone.

    The capture is ``torch.cuda.graph``'s steps, each undone on a failure: on the memory's
    stream for this point's device (``torch.cuda.graph`` keeps one per process, on the first
    device that captured), restored whatever happens (its ``__exit__`` ends the capture before it
    restores the stream, without ``finally``: a call that fails inside the capture left the
    capture stream current); a call that fails inside it raises its own error, not the failed
    end of the capture that follows it, and a capture that cannot be ended raises
    ``CaptureLeftOpen``."""
    memory = memory or GraphMemory()
    stream = memory.stream(device)
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # capture needs a side stream with the work warmed up on it
        for _ in range(3):
            if before:
                before()
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    if before:
        before()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()  # as torch.cuda.graph does: nothing else in flight
    torch.cuda.empty_cache()  # the warm-up's blocks: not the graph's (live pools are kept)
    reserved = torch.cuda.memory_reserved()
    pool = memory.pool(device)
    with torch.cuda.stream(stream):
        graph.capture_begin(pool=pool)
        try:
            result = fn()
        except BaseException as cause:
            memory.failed = f"{type(cause).__name__}: {cause}"
            _end_failed(graph, cause, device, pool)
            raise
        graph.capture_end()

    def replay():
        graph.replay()
        return result

    replay.graph = graph  # kept alive with the replay: its memory pool holds the outputs
    replay.nbytes = max(0, torch.cuda.memory_reserved() - reserved)
    return replay


def _end_failed(graph, cause: BaseException, device: str = "cuda", pool=None) -> None:
    """End a capture that ``cause`` broke; its own failure to end says less than the cause (an
    invalidated capture cannot end cleanly). A ``capture_end`` that raises skips the allocator's
    ``endAllocateToPool`` on torch < 2.12 (pytorch#180395): the allocator would go on believing
    a capture is under way and later allocations of the worker fail (false ``oom`` rows), so it
    is ended here; where it was ended, the allocator says so and nothing changes. Still
    capturing: ``CaptureLeftOpen``."""
    try:
        graph.capture_end()
    except Exception:  # noqa: BLE001 (the cause speaks)
        if pool is not None:
            try:
                index = torch.device(device).index
                index = torch.cuda.current_device() if index is None else index
                torch._C._cuda_endAllocateToPool(index, pool)
            except (RuntimeError, AttributeError, TypeError):  # ended already, or no such hook
                pass
    if torch.cuda.is_current_stream_capturing():
        raise CaptureLeftOpen(
            f"{type(cause).__name__}: {cause}; the capture it broke could not be ended"
        ) from cause


def sampler(fn: Callable[[], object], device: str, flush_l2: bool):
    """Times ``fn`` in ms: ``sampler()`` one call, ``sampler.batch(n, before)`` n calls (device
    time on CUDA, queued; wall time on the CPU)."""
    return _CudaSampler(fn, device, flush_l2) if device.startswith("cuda") else _CpuSampler(fn)


def repetition(
    sample: Callable[[], float], calls: int, before: Callable[[], object] | None, warm: bool
) -> float:
    """One round's value: the median of ``calls`` timed calls, after one untimed call when
    ``warm`` (the point before it left other data in the caches). ``before`` runs before every
    call, untimed. A sampler with ``batch`` times the calls as one batch (queued on CUDA)."""
    batch = getattr(sample, "batch", None)
    if batch is not None:
        return statistics.median(batch(calls + warm, before)[int(warm) :])
    times = []
    for i in range(calls + warm):
        if before:
            before()
        t = sample()
        if i >= warm:
            times.append(t)
    return statistics.median(times)


def measure(
    fn: Callable[[], object],
    device: str,
    timing: Window,
    before_sample: Callable[[], object] | None = None,
) -> TimingResult:
    """Time ``fn`` in one window (the matmul peak, validate_timer): wall time, or on the CPU with
    one thread the calling thread's CPU time (as the rounds time such a point: ``Session.method``).
    ``before_sample`` runs before every call, outside the timed region (e.g. clear grads)."""
    cuda = device.startswith("cuda")
    prepare = before_sample or (lambda: None)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    max_noise = (
        timing.max_noise
        if timing.max_noise is not None
        else WINDOW_NOISE["cuda" if cuda else "cpu"]
    )
    window_start = time.perf_counter()

    # Warm-up by time, not by count: the first calls pay for allocation, autotuning and
    # (with torch.compile) guard checks; two calls at least whatever the budget.
    calls = 0
    while calls < 2 or time.perf_counter() - window_start < timing.warmup:
        prepare()
        fn()
        sync()
        calls += 1
    if cuda and timing.cuda_graph:
        fn = cuda_graph(fn, before_sample)
    sample = sampler(fn, device, timing.flush_l2)
    cpu_clock = not cuda and torch.get_num_threads() == 1

    samples: list[float] = []
    noise = math.inf
    start = time.perf_counter()
    while len(samples) < timing.max_samples:
        # A batch at a time (queued on CUDA, as the rounds time: ``_CudaSampler``): up to
        # NOISE_CHECK_EVERY calls, no more than min_samples asks for before it is reached.
        n = len(samples)
        size = min(NOISE_CHECK_EVERY, timing.max_samples - n)
        if n < timing.min_samples:
            size = min(size, timing.min_samples - n)
        times = sample.batch(size, prepare)
        # one CPU thread: its CPU time, as the rounds time such a point (Session.method), so that
        # a peak measured on a busy machine is not the busy machine's (race said "% peak 95.8"
        # of a peak read 4x low)
        cpu = cpu_clock and sample.cpu_times and sample.blocked <= BLOCKED
        samples.extend(sample.cpu_times if cpu else times)
        n, elapsed = len(samples), time.perf_counter() - start
        if n < timing.min_samples:
            continue
        if elapsed >= timing.max_time:
            break
        if elapsed >= timing.min_time:  # after every batch: each is at most NOISE_CHECK_EVERY calls
            noise = relative_noise(samples)
            if noise <= max_noise:
                break

    p10, q1, med, q3, p90 = quantiles(samples)
    return TimingResult(
        median_ms=med,
        iqr_ms=q3 - q1,
        p10_ms=p10,
        p90_ms=p90,
        n_samples=len(samples),
        noise=relative_noise(samples),
        max_noise=max_noise,
        window_s=time.perf_counter() - window_start,
        launch_ms=getattr(sample, "launch_ms", None),
    )


@contextlib.contextmanager
def paused_gc():
    """No garbage collection inside a repetition (as timeit does): with a sweep's models, inputs
    and compiled graphs alive, a collection that starts among the timed calls walks all of them,
    and on CUDA it stalls Python's launches, which the eager call's events then count."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
