"""A point ready to be timed (``Session``): its warm-up, its CUDA graph, one repetition at a
time, the re-check and the leak check after its rounds; also what pairs a way with its reference
(``Point.shape_key``). Which repetition runs when is the rounds' (harness/measure/rounds.py);
what they found, its figures (harness/measure/figures.py)."""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from harness.measure import clocks, contention
from harness import envinfo
from harness.config import Point
from harness.errors import BrokenDevice, after_check, classify, is_sticky, one_line, traceback_of
from harness.measure.journal import Journal, Sample
from harness.measure.phase import phase
from harness.way.compiling import GRAPH_MODES, compiled_graphs
from harness.envinfo import use_device
from harness.way.calls import sdpa_context
from harness.measure.memory import (
    call_peak,
    grew_steadily,
    leak_columns,
    memory_in_use,
    regrows,
    release_memory,
)
from harness.measure.timing import (
    BLOCKED,
    CaptureLeftOpen,
    GraphMemory,
    cuda_graph,
    paused_gc,
    cpu_figures,
    repetition,
    sampler,
)

# A graph's pool against its call's peak (Session.graph_bytes): blocks of 1-10 MB take a 20 MB
# segment each, larger ones are rounded to 2 MB (the caching allocator's rules).
GRAPH_MARGIN, GRAPH_SEGMENT = 1.25, 20 * 2**20
# With the CPU clock, a repetition in which the process's other threads used more CPU than this
# share of the timed thread's is spoiled: the thread's time is not the calls' whole cost (a
# thread a variant left running, say), and the wall time would show it where the CPU time hides it.
OTHER_THREADS = 0.05
# Variants that are nn.MultiheadAttention itself: with compile off and no SDPA pin, such a point
# is its shape's reference, and its speedup is exactly 1.
REFERENCE_TARGETS = {
    "variants.reference.ReferenceMHA",
    "torch.nn.MultiheadAttention",
    "torch.nn.modules.activation.MultiheadAttention",
}


def is_reference(point: Point) -> bool:
    return (
        point.variant.target in REFERENCE_TARGETS
        and point.compile == "off"
        and point.sdpa_backend == "auto"
    )


def min_clean(point: Point) -> int:
    """Clean rounds a point needs for its figures to count: two thirds of ``timing.rounds``
    (two at least). With fewer, contention spoiled it (``contended``)."""
    return max(2, math.ceil(point.timing.rounds * 2 / 3))


@dataclass(eq=False)
class Session:
    """A point ready to be timed: warmed up, its calls per repetition chosen."""

    point: Point
    call: Callable[[], object]
    before: Callable[[], object] | None
    nbytes: int
    # gets what the rounds found (harness/measure/figures.py's ``Timed``), or the failure, at the
    # rounds' end; None: a reference for pairing
    finish: Callable[[object, tuple[str, str, str] | None], None] | None
    reference: bool = False
    sample: Callable[[], float] | None = None
    calls: int = 1
    host_ms: float | None = None  # median synchronised warm-up call, ms
    warm: bool = True
    setup_s: float = 0.0  # warm-up and calibration
    rep_s: float = 0.0  # expected seconds of one repetition
    samples: list[Sample] = field(default_factory=list)  # its repetitions, resumed ones first
    spent_s: float = 0.0  # time in this point's repetitions
    recompiles: int = 0  # graphs compiled after the first call and before the rounds
    failure: tuple[str, str, str] | None = None  # status, error, traceback
    tag: object = None  # who the session belongs to (the worker's point id), for on_visit
    journal: Journal | None = None  # where each repetition is recorded as it ends (resume reads it)
    journal_key: str | None = None
    leak_confirmed: bool | None = None  # the second measurement (None: not made)
    clock: Callable[[], tuple] | None = None  # the GPU's clocks, read during each repetition
    clocks: list = field(default_factory=list)  # those readings (this run's repetitions)
    launches: list = field(default_factory=list)  # CUDA: ms to enqueue a call, per repetition
    # How ``sample`` times (the row's ``timed_by``, ``method``): on the CPU "cpu" with one thread
    # (the timed thread's CPU time decides: a busy machine's waits are not in it), "wall" with
    # several (CPU time there is the threads' work, not a latency); on CUDA "graph" (the call
    # captured once in a CUDA graph and replayed: device time without launch gaps) or "events"
    # (the eager call between CUDA events), with ``graph_error`` saying why not a graph.
    timed_by: str = "wall"
    graph_error: str | None = None
    replay: Callable[[], object] | None = None  # the graph's replay ("graph")
    # "graph": the eager call, timed beside the replay in every repetition (the eager call time)
    eager_sample: Callable[[], float] | None = None
    eager_calls: int = 1
    eager_warm: bool = True
    # "graph" with timing.flush_l2: the replay without the flush, timed beside the eager call in
    # every repetition: launch_bound compares the eager call with it, both with the L2 as the
    # previous call left it (against the flushed replay an L2-resident decode paced by Python
    # read as GPU-bound)
    warm_sample: Callable[[], float] | None = None
    call_bytes: int = 0  # CUDA: a warm call's peak allocation (what its graph will hold)
    replays: int = 0  # replays made in the rounds (the re-check's "after N timed calls")
    # one more call after the rounds, compared with the checked output (harness/way/recheck.py);
    # what it found (None: the same output, or not re-checked)
    recheck: Callable | None = None
    changed: str | None = None
    # What each repetition of this run saw of the machine (harness/measure/contention.py) and
    # why it was spoiled (None: clean); the probe that reads it.
    probe: contention.Probe | None = None
    seen: list = field(default_factory=list)
    spoiled: list = field(default_factory=list)
    # what its variant changed of torch (harness/fingerprint.py's ``World``): in place while its
    # own calls run (repetitions, capture, re-check), torch as found for everyone else's
    world: object = None

    @property
    def key(self):
        return self.point.shape_key()

    def prepare(self) -> "Session":
        """Warm up by time (at least two calls), choose the calls per repetition from the fastest
        warm call, and on CUDA measure a warm call's peak allocation (``call_bytes``): what its
        graph will hold, known before the pool captures it (``capture``) and can make room."""
        p, t0 = self.point, time.perf_counter()
        cuda = p.device.startswith("cuda")
        # The warm-up's synchronize acts on the current GPU (points on several: cuda:N).
        use_device(p.device)
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        with sdpa_context(p.sdpa_backend):
            calls, waits = 0, []
            while calls < 2 or time.perf_counter() - t0 < p.timing.warmup:
                if self.before:
                    self.before()
                # the first warm call's own memory (what its graph will hold), read outside its wait
                with call_peak(p.device if calls == 1 else "") as peak:
                    start = time.perf_counter()
                    self.call()
                    sync()
                    wait = time.perf_counter() - start
                self.call_bytes = peak.bytes or self.call_bytes
                if calls:  # the first call pays for allocation and autotuning
                    waits.append(wait)
                calls += 1
            one_s = min(waits)
            # What a caller that waits for every call waits (host_ms_per_call): on CUDA the
            # launches included, which the rounds' queued device time hides.
            self.host_ms = statistics.median(waits) * 1e3
            self.sample = sampler(self.call, p.device, p.timing.flush_l2)
            # Whole calls within round_time (one at least); an untimed warming call first only
            # when calls are short, where the caches another point left behind would show.
            self.calls, self.warm = _calls(one_s, p.timing.round_time)
            self.rep_s = (self.calls + self.warm) * one_s
            # on CUDA until captured (capture)
            self.timed_by = "events" if cuda else ("cpu" if p.num_threads == 1 else "wall")
            self.clock = clocks.reader(p.device)
            self.probe = contention.Probe(gpu=clocks.processes(p.device))
            if self.clock is not None and hasattr(self.sample, "during"):
                self.sample.during = self.read_clock  # while the repetition runs on the GPU
        self.setup_s = time.perf_counter() - t0
        return self

    def graph_bytes(self) -> int:
        """What capturing it will add: its warm call's peak, room for the allocator's rounding."""
        p = self.point
        later = p.timing.cuda_graph and p.compile not in GRAPH_MODES and self.replay is None
        return (
            int(self.call_bytes * GRAPH_MARGIN) + GRAPH_SEGMENT if later and self.call_bytes else 0
        )

    def capture(self, memory: GraphMemory | None = None) -> None:
        """CUDA: capture the call in a CUDA graph (in ``memory``, its block's pool; None: its
        own), its replay timed as the device time, the eager call beside it. A call that cannot
        be captured keeps its event timing and says why (``graph_error``); one that breaks the
        device is the point's failure."""
        p = self.point
        if not p.device.startswith("cuda") or self.replay is not None:
            return
        if not p.timing.cuda_graph:
            self.graph_error = "timing.cuda_graph=false"
            return
        if p.compile in GRAPH_MODES:
            self.graph_error = f"compile={p.compile} replays CUDA graphs of its own"
            return
        use_device(p.device)  # the pool may capture it after other points on other GPUs
        try:
            with self.own_world(), sdpa_context(p.sdpa_backend):
                replay = cuda_graph(self.call, self.before, memory, p.device)
            torch.cuda.synchronize()
        except CaptureLeftOpen as e:  # a synchronize now could abort the process
            raise BrokenDevice(one_line(e)) from e
        except Exception as e:  # noqa: BLE001 (any reason a call cannot be captured)
            said = one_line(e)
            try:  # a failed capture leaves the device usable, unless the error is sticky
                torch.cuda.synchronize()
            except Exception as after:  # noqa: BLE001
                said = one_line(after) if is_sticky(one_line(after)) else said
            if is_sticky(said):
                raise BrokenDevice(said) from e
            self.graph_error = f"not captured in a CUDA graph: {said}"
            return
        self.nbytes += replay.nbytes  # its pool waits with it: the budget counts it (Pool.add)
        device = sampler(replay, p.device, p.timing.flush_l2)
        # One replay's time, with the L2 flush that precedes each: the replays per repetition.
        flush = getattr(device, "cache", None)
        waits = []
        for _ in range(3):
            if self.before:
                self.before()
            start = time.perf_counter()
            if flush is not None:
                flush.zero_()
            replay()
            torch.cuda.synchronize()
            waits.append(time.perf_counter() - start)
        # The eager call as a loop makes them: back to back, no L2 flush between. A flush would
        # hide Python's launches: the GPU zeroes 256 MiB (~85 us on an H100) while Python starts
        # enqueuing the call, and the events then read less than a caller waits.
        self.eager_sample = sampler(self.call, p.device, False)
        self.eager_calls, self.eager_warm = self.calls, self.warm
        if flush is not None:
            self.warm_sample = sampler(replay, p.device, False)
        self.sample, self.replay, self.timed_by = device, replay, "graph"
        self.calls, self.warm = _calls(min(waits), p.timing.round_time)
        # the replays of a repetition, twice where the warm replay is timed beside them
        self.rep_s += (self.calls + self.warm) * min(waits) * (2 if self.warm_sample else 1)

    def read_clock(self) -> None:
        """NVML's reading, taken while a repetition's queued calls run (outside their events);
        a failed read is no reading."""
        try:
            self.clocks.append(self.clock())
        except Exception:
            pass

    def run_recheck(self) -> None:
        """Timed equals checked: one more call, untimed, after its ``before`` (the rewind), of
        each way the rounds timed it: the graph's replay (the device time) and the eager call. A
        different output makes the row a ``mismatch`` (``columns``); a failure of that call is
        the point's failure."""
        if self.recheck is None or self.failure is not None or self.call is None:
            return
        p = self.point
        use_device(p.device)
        try:
            with self.own_world(), sdpa_context(p.sdpa_backend):
                if self.replay is not None:
                    self.changed = self.recheck.replayed(self.replay, self.before, self.replays)
                if self.changed is None:
                    self.changed = self.recheck(self.call, self.before)
        except (Exception, SystemExit) as e:
            said = after_check(e, "the re-check after the rounds")
            self.failure = (classify(e), said, traceback_of(e))

    def method(self) -> tuple[str, str]:
        """How its figures were timed (the row's ``timed_by``) and the samples' field that holds
        them: "cpu" and ``cpu_ms`` where its thread's CPU time decides and every repetition has
        one (a repetition resumed from a run before the CPU clock has none: then "wall", ``ms``;
        a point whose calls blocked is timed by the wall clock, ``repeat``)."""
        if self.timed_by == "cpu":
            if all(x.cpu_ms is not None for x in self.samples):
                return "cpu", "cpu_ms"
            return "wall", "ms"
        return self.timed_by, "ms"

    def own_world(self):
        """Its variant's changes to torch in place for the block (none: nothing to do)."""
        return self.world.entered() if self.world is not None else contextlib.nullcontext()

    def by_round(self) -> dict[int, Sample]:
        """One sample per round, the latest (a reference may repeat a round for a resumed point)."""
        return {s.round: s for s in self.samples}

    def needs(self, round_no: int, reference: "Session | None" = None) -> bool:
        """Round ``round_no`` is still to run for this point: one of its ``timing.rounds``, or
        one of the ``timing.retime_rounds`` after them while it has fewer clean rounds (paired
        with a clean one of ``reference``) than ``timing.rounds``."""
        t = self.point.timing
        if self.failure is not None or any(s.round == round_no for s in self.samples):
            return False
        if round_no < t.rounds:
            return True
        return round_no < t.rounds + t.retime_rounds and len(self.clean(reference)) < t.rounds

    def clean(self, reference: "Session | None" = None) -> list[Sample]:
        """This point's rounds that contention did not spoil, in round order; with a
        ``reference`` (not itself), only those whose round is clean for the reference too."""
        kept = [s for s in sorted(self.by_round().values(), key=lambda s: s.round)]
        kept = [s for s in kept if not s.contended]
        if reference is None or reference is self:
            return kept
        theirs = {(s.run, s.round) for s in reference.samples if not s.contended}
        return [s for s in kept if (s.run, s.round) in theirs]

    def stayed_contended(self, reference: "Session | None" = None) -> bool:
        """Contention spoiled rounds of this point or of its pairs: fewer ``clean`` than needed."""
        ref = None if self.reference else reference
        if len(self.clean(ref)) >= min_clean(self.point):
            return False  # (a round a kill left unpaired is not contention: partial, not this)
        ok = {(x.run, x.round) for x in ref.samples if not x.contended} if ref else set()
        spoiled = {(x.run, x.round) for x in ref.samples if x.contended} - ok if ref else set()
        return any(x.contended or (x.run, x.round) in spoiled for x in self.samples)

    def repeat(self, round_no: int, run: str) -> None:
        """One repetition, recorded as this round's sample (and journaled at once); a failure ends
        the point's rounds."""
        p = self.point
        torch.set_num_threads(p.num_threads)
        use_device(p.device)  # a worker may time points on several GPUs
        t0, at = time.perf_counter(), time.time()
        graphs = compiled_graphs()
        held = memory_in_use(p.device)
        eager = warm = None
        before = self.probe.read() if self.probe is not None else None
        try:
            with self.own_world(), paused_gc(), sdpa_context(p.sdpa_backend), phase("rounds"):
                ms = repetition(self.sample, self.calls, self.before, self.warm)
                if self.eager_sample is not None:
                    self.replays += self.calls + self.warm
                    eager = repetition(
                        self.eager_sample, self.eager_calls, self.before, self.eager_warm
                    )
                if self.warm_sample is not None:
                    self.replays += self.calls + self.warm
                    warm = repetition(self.warm_sample, self.calls, self.before, self.warm)
        # one point's failure must not end the rounds of the others
        except (Exception, SystemExit) as e:
            self.failure = (classify(e), after_check(e, "a timed call"), traceback_of(e))
            if is_sticky(self.failure[1]):  # every later call in this process fails too
                raise BrokenDevice(self.failure[1]) from e
        finally:
            self.spent_s += time.perf_counter() - t0
        if self.failure is not None:
            # No more calls: let its model, inputs and outputs go now, not when the rounds end,
            # so that the points still being timed do not run short of memory (a false oom).
            self.release()
            release_memory(p.device)
            return
        cpu_ms, others_ms = cpu_figures(self.sample, self.warm)
        if cpu_ms is not None and cpu_ms <= 0:
            cpu_ms = None  # a clock that did not move: no CPU figure for this repetition
        if self.timed_by == "cpu" and getattr(self.sample, "blocked", 0.0) > BLOCKED:
            # its calls sleep, read or wait on another process: off the CPU without waiting for
            # one, which the CPU clock would not see; the wall clock times it from here on
            self.timed_by = "wall"
        spoiled = None
        if before is not None:
            seen = contention.between(before, self.probe.read())
            clock = "cpu" if self.timed_by == "cpu" else "wall"
            spoiled = seen.spoiled(p.num_threads, envinfo.available_cores(), clock)
            if clock == "cpu" and cpu_ms is not None and not spoiled:
                spoiled = _other_threads(others_ms, cpu_ms * (self.calls + self.warm))
            self.seen.append(seen)
            self.spoiled.append(spoiled)
        growth = None if held is None else memory_in_use(p.device) - held
        # CUDA only (timing._CudaSampler): the eager call's enqueue time
        launch = getattr(self.eager_sample or self.sample, "launch_ms", None)
        if launch is not None:
            self.launches.append(launch)
        sample = Sample(
            round_no,
            at,
            ms,
            run,
            growth,
            compiled_graphs() - graphs,
            eager,
            spoiled is not None,
            warm,
            cpu_ms,
        )
        self.samples.append(sample)
        if self.journal is not None and self.journal_key is not None:
            self.journal.append(self.journal_key, sample)

    def release(self) -> None:
        """Let go of everything a call holds (its model, inputs, outputs, CUDA graph): after a
        failure, and when the rounds have ended and its row is written. A graph keeps its block's
        whole shared pool reserved while it lives (the allocator frees a pool with its last
        graph), so one session kept past its rounds (the worker's last) would hold the pool
        through the next point's check and warm-up."""
        self.call = self.before = self.sample = self.eager_sample = self.replay = None
        self.warm_sample = self.recheck = None

    def growth(self) -> list[int]:
        return [
            s.growth
            for s in sorted(self.by_round().values(), key=lambda s: s.round)
            if s.growth is not None
        ]

    def grew_steadily(self) -> bool:
        return grew_steadily(self.growth())

    def confirm_leak(self) -> bool:
        """The second measurement (memory.regrows): as many calls as the rounds made."""
        calls = sum(self.calls + self.warm for _ in self.growth())
        with self.own_world(), sdpa_context(self.point.sdpa_backend):
            self.leak_confirmed = regrows(
                self.call, self.before, self.point.device, calls, sum(self.growth())
            )
        return self.leak_confirmed


    def leak_columns(self) -> dict:
        """``mem_growth_mb`` and ``leak`` (harness/measure/memory.py's ``leak_columns``)."""
        return leak_columns(self.growth(), self.leak_confirmed)


def _other_threads(others_ms: float, thread_ms: float) -> str | None:
    """Why a CPU-clock repetition is spoiled by the process's own other threads (None: they
    were idle): their CPU time is not in the timed thread's, though the calls may have waited on
    it (a thread a variant left running holds the GIL)."""
    if others_ms > max(0.5, OTHER_THREADS * thread_ms):
        return f"other threads of this process used {others_ms:.1f} ms of CPU beside the calls"
    return None


def _calls(one_s: float, round_time: float) -> tuple[int, bool]:
    """Whole calls of ``one_s`` within ``round_time`` (one at least), and whether an untimed
    warming call goes first: where calls are short, the caches another point left would show."""
    return max(1, int(round_time / max(one_s, 1e-7))), one_s < round_time / 4
