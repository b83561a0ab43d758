"""Timing in rounds: every timed point is repeated in short repetitions spread over the sweep,
interleaved with the other ways at its shape and with nn.MultiheadAttention timed alongside.

Why: on a shared machine speed drifts by 10-25% over minutes while each 1-2 s window looks
quiet. Timing a point once, in one window, gives a figure that a re-run does not reproduce and a
noise estimate ~20x too small. Here (DESIGN.md, "Measurement you can act on"):

- A point's Hydra job builds, checks, warms up and probes its point, then hands a ``Session``
  (its timed callable, ready to run) to the process's ``Pool`` and returns.
- The pool runs ``timing.rounds`` rounds. In round r it visits every shape in a shuffled order
  and, at each shape, every way in a shuffled order (nn.MultiheadAttention among them), timing
  each for one repetition of about ``timing.round_time`` seconds (the median of its calls).
  Round r+1 starts only after round r has visited every shape, so each point's repetitions span
  the whole timing phase and their spread sees the machine's drift.
- The speedup of a way is computed per round against nn.MultiheadAttention timed a fraction of
  a second before or after it (paired), which cancels the drift both saw.
- Where the pool lives: in the worker process that runs the points (harness/sweep/worker.py). With
  Hydra's basic launcher every job runs in the sweeper's process and so uses one worker: its
  pool collects every point and the sweeper asks for the rounds after the last job (earlier, at
  a shape boundary, when the waiting points would hold more memory than ``timing.resident_mb``:
  each such part is a block, rounds spread over the block). Jobs that run in other processes
  (joblib, submitit, SLURM), a single run and ``run_point`` time their point in a pool of their
  own: the same rounds, back to back, paired with a reference of their own. Their intervals see
  only their own few seconds.
- A shape whose reference is not among the sweep's points (``sweep=toggles``, say) gets one
  built for pairing (nn.MultiheadAttention in the point's dtype on the same inputs, no row).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from harness.measure import stats
from harness.config import Point
from harness.errors import classify, one_line
from harness.inputs import Inputs, make_inputs, make_reference
from harness.measure.timing import cuda_graph, quantiles, repetition, sampler

# timing.max_noise=null: target relative half-width. Above the floor that timing.rerun_noise
# puts under every interval (sinh(1.96 x 0.04) = 7.9% by default; config.parse_timing).
DEFAULT_NOISE = {"cuda": 0.10, "cpu": 0.10}
# Variants that are nn.MultiheadAttention itself: with compile off and no SDPA pin, such a point
# is its shape's reference, and its speedup is exactly 1.
REFERENCE_TARGETS = {"variants.reference.ReferenceMHA", "torch.nn.MultiheadAttention",
                     "torch.nn.modules.activation.MultiheadAttention"}


def sdpa_context(backend: str):
    """Pin F.scaled_dot_product_attention to one backend (``auto``: let PyTorch choose)."""
    if backend == "auto":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel({"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                        "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}[backend])


def timed_call(model, fn, inputs: Inputs, mode: str):
    """The zero-argument callable to time and what to run before each call, untimed."""
    q, k, v, kwargs, grad_out = inputs.query, inputs.key, inputs.value, inputs.kwargs, inputs.grad_out
    if mode == "fwd":
        def call():
            with torch.no_grad():
                return fn(q, k, v, **kwargs)
        return call, None

    leaves = list(inputs.named().values())

    def clear_grads():
        model.zero_grad(set_to_none=True)
        for t in leaves:
            t.grad = None

    def call():
        out, _ = fn(q, k, v, **kwargs)
        out.backward(grad_out)
    return call, clear_grads


def shape_key(point: Point):
    """What pairs a way with its reference: the point less the way of writing it (variant and
    options, compile, SDPA pin) and how it is measured."""
    return dataclasses.replace(point, variant=None, compile="off", sdpa_backend="auto", check_only=False,
                               timing=None, profile=False, profiler=None)


def is_reference(point: Point) -> bool:
    return (point.variant.target in REFERENCE_TARGETS and point.compile == "off"
            and point.sdpa_backend == "auto")


def max_noise(point: Point) -> float:
    if point.timing.max_noise is not None:
        return point.timing.max_noise
    return DEFAULT_NOISE["cuda" if point.device.startswith("cuda") else "cpu"]


def held_bytes(model: torch.nn.Module, inputs: Inputs, grad: bool) -> int:
    """Memory a waiting point holds: its weights and inputs (twice with their gradients)."""
    seen, total = set(), 0
    tensors = [*model.parameters(), *model.buffers(), inputs.query, inputs.key, inputs.value, inputs.grad_out,
               *(v for v in inputs.kwargs.values() if isinstance(v, torch.Tensor))]
    for t in tensors:
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size() * (2 if grad else 1)
    return total


def compiled_graphs() -> int:
    if "torch._dynamo" not in sys.modules:  # importing dynamo costs a second; nothing compiled yet
        return 0
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def memory_in_use(device: str) -> int | None:
    """Bytes the process holds on ``device``: CUDA tensors, or the CPU's resident set."""
    if device.startswith("cuda"):
        return torch.cuda.memory_allocated(device)
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None  # not Linux: no leak column


# A leak: memory grew over the point's repetitions by at least LEAK_MB, in at least LEAK_SHARE of
# them (a steady-state call frees what it allocates; one-off growth, such as an allocator taking
# a fresh arena, happens in one repetition, not in most).
LEAK_MB = 1.0
LEAK_SHARE = 0.75


@dataclass(eq=False)
class Session:
    """A point ready to be timed: warmed up, its calls per repetition chosen."""
    point: Point
    call: Callable[[], object]
    before: Callable[[], object] | None
    nbytes: int
    # Receives the timing columns (or the failure) when the rounds are over; None for a
    # reference built only for pairing.
    finish: Callable[[dict, tuple[str, str] | None], None] | None
    reference: bool = False
    sample: Callable[[], float] | None = None
    calls: int = 1
    warm: bool = True
    setup_s: float = 0.0  # warm-up and calibration
    rep_s: float = 0.0  # expected seconds of one repetition
    samples: list = field(default_factory=list)  # (round, seconds since the pool started, ms)
    spent_s: float = 0.0  # time in this point's repetitions
    recompiles: int = 0
    failure: tuple[str, str] | None = None
    tag: object = None  # who the session belongs to (the worker's point id), for on_visit
    growth: list = field(default_factory=list)  # bytes the process gained over each repetition

    @property
    def key(self):
        return shape_key(self.point)

    def prepare(self) -> "Session":
        """Warm up by time (at least two calls), capture a CUDA graph when asked, and choose the
        calls per repetition from the fastest warm-up call after the first."""
        p, t0 = self.point, time.perf_counter()
        cuda = p.device.startswith("cuda")
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        with sdpa_context(p.sdpa_backend):
            calls, one_s = 0, math.inf
            while calls < 2 or time.perf_counter() - t0 < p.timing.warmup:
                if self.before:
                    self.before()
                start = time.perf_counter()
                self.call()
                sync()
                if calls:  # the first call pays for allocation and autotuning
                    one_s = min(one_s, time.perf_counter() - start)
                calls += 1
            fn = cuda_graph(self.call) if cuda and p.timing.cuda_graph else self.call
            self.sample = sampler(fn, p.device, p.timing.flush_l2)
        # Whole calls within round_time (one at least); an untimed warming call first only when
        # calls are short, where the caches another point left behind would show.
        self.calls = max(1, int(p.timing.round_time / max(one_s, 1e-7)))
        self.warm = one_s < p.timing.round_time / 4
        self.rep_s = (self.calls + self.warm) * one_s
        self.setup_s = time.perf_counter() - t0
        return self

    def repeat(self, round_no: int, since: float) -> None:
        """One repetition, recorded as this round's sample; a failure ends the point's rounds."""
        p = self.point
        torch.set_num_threads(p.num_threads)
        t0 = time.perf_counter()
        graphs = compiled_graphs()
        held = memory_in_use(p.device)
        try:
            with sdpa_context(p.sdpa_backend):
                ms = repetition(self.sample, self.calls, self.before, self.warm)
        except (Exception, SystemExit) as e:  # one point's failure must not end the rounds of the others
            self.failure = (classify(e), one_line(e))
            if p.device.startswith("cuda"):
                torch.cuda.empty_cache()
            return
        finally:
            self.spent_s += time.perf_counter() - t0
        self.recompiles += compiled_graphs() - graphs
        if held is not None:
            self.growth.append(memory_in_use(p.device) - held)
        self.samples.append((round_no, t0 - since, ms))

    def active(self, round_no: int) -> bool:
        return self.failure is None and round_no < self.point.timing.rounds

    def columns(self, reference: "Session | None") -> dict:
        """The row's timing columns (README "Results"): latency and its interval over the
        rounds, and the speedup over nn.MultiheadAttention paired round by round."""
        ms = [m for _, _, m in self.samples]
        floor = self.point.timing.rerun_noise
        latency = stats.log_interval(ms, floor)
        if self.reference:
            speedup = stats.Interval(1.0, 1.0, 1.0, len(ms)) if ms else stats.NAN
        elif reference is not None and reference.samples:
            ref_by_round = {r: m for r, _, m in reference.samples}
            pairs = [(ref_by_round[r], m) for r, _, m in self.samples if r in ref_by_round]
            speedup = stats.paired_ratio([a for a, _ in pairs], [b for _, b in pairs], floor)
        else:
            speedup = stats.NAN
        paired = not self.reference and not math.isnan(speedup.center)
        noise = speedup.rel_halfwidth if paired else latency.rel_halfwidth
        q = quantiles(ms) if ms else [math.nan] * 5
        times = [t for _, t, _ in self.samples]
        return dict(
            latency_ms_median=latency.center, latency_ms_ci_low=_num(latency.low),
            latency_ms_ci_high=_num(latency.high), latency_ms_iqr=q[3] - q[1], latency_ms_p10=q[0],
            latency_ms_p90=q[4], speedup=_num(speedup.center), speedup_ci_low=_num(speedup.low),
            speedup_ci_high=_num(speedup.high), n_samples=len(ms), calls_per_round=self.calls,
            rounds_span_s=max(times) - min(times) if times else None, noise=noise,
            noise_target_met=bool(noise <= max_noise(self.point)), timing_s=self.setup_s + self.spent_s,
            recompiles=self.recompiles, **self.leak_columns(),
        )

    def leak_columns(self) -> dict:
        """``mem_growth_mb``: net memory gained over the timed repetitions; ``leak``: whether it
        grew steadily (LEAK_MB, LEAK_SHARE)."""
        if not self.growth:
            return {}
        grew = sum(1 for g in self.growth if g > 0)
        total_mb = sum(self.growth) / 2**20
        return dict(mem_growth_mb=total_mb,
                    leak=bool(len(self.growth) >= 2 and total_mb >= LEAK_MB and grew >= LEAK_SHARE * len(self.growth)))


def _num(x: float):
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else x


def reference_session(point: Point) -> Session:
    """nn.MultiheadAttention at ``point``'s shape, dtype and inputs, ready to be timed, for a
    shape whose reference is not among the points."""
    grad = point.mode == "fwd_bwd"
    model = make_reference(point).to(point.device, point.torch_dtype)
    inputs = make_inputs(point).to(point.device, point.torch_dtype, grad)
    ref_point = dataclasses.replace(point, compile="off", sdpa_backend="auto")
    call, before = timed_call(model, model, inputs, point.mode)
    return Session(ref_point, call, before, held_bytes(model, inputs, grad), finish=None, reference=True).prepare()


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60}:{seconds % 60:02d}"


def run_rounds(sessions: list[Session], say: Callable[[str], None] = print,
               on_visit: Callable[[Session, int], None] | None = None,
               stop: Callable[[], bool] | None = None) -> None:
    """Time ``sessions`` in interleaved rounds, then hand each its columns (``Session.finish``).

    ``on_visit(session, round)`` is called before each repetition (the worker tells its job
    process whose call is running); ``stop()`` true between two repetitions ends the rounds as
    Ctrl-C does."""
    groups: dict = {}
    for s in sessions:
        groups.setdefault(s.key, []).append(s)
    references: dict = {}
    for key, members in groups.items():
        ref = next((s for s in members if s.reference), None)
        if ref is None:
            try:
                ref = reference_session(members[0].point)
                members.append(ref)
            except Exception as e:  # no reference: the rows have no speedup, and say why
                say(f"rounds: no nn.MultiheadAttention to pair with at {members[0].point.variant.name}'s shape "
                    f"({one_line(e)}); its rows get no speedup")
        references[key] = ref
    total = max(s.point.timing.rounds for s in sessions)
    n_points = sum(1 for s in sessions if s.finish is not None)
    start = time.perf_counter()
    say(f"rounds: timing {n_points} points at {len(groups)} shapes in {total} interleaved rounds")
    try:
        for r in range(total):
            rng = random.Random(r)  # a fresh order each round, the same in every run
            keys = list(groups)
            rng.shuffle(keys)
            for key in keys:
                members = [s for s in groups[key] if s.active(r)]
                rng.shuffle(members)
                for s in members:
                    if stop is not None and stop():
                        raise KeyboardInterrupt
                    if on_visit is not None:
                        on_visit(s, r)
                    s.repeat(r, start)
            elapsed = time.perf_counter() - start
            say(f"round {r + 1}/{total} done: {_clock(elapsed)} elapsed, "
                f"~{_clock(elapsed / (r + 1) * (total - r - 1))} left")
    finally:  # Ctrl-C included: every point that has rounds gets them (one without any is not finished)
        for key, members in groups.items():
            ref = references[key]
            for s in members:
                if s.finish is not None and (s.samples or s.failure):
                    s.finish(s.columns(ref if ref is not None and ref.failure is None else None), s.failure)


class Pool:
    """Points waiting for their rounds, in arrival order. ``run`` times them and empties it.
    ``say``, ``on_visit`` and ``stop`` are passed to ``run_rounds``."""

    def __init__(self, say: Callable[[str], None] = print, on_visit=None, stop=None):
        self.sessions: list[Session] = []
        self.held = 0
        self.say, self.on_visit, self.stop = say, on_visit, stop

    def add(self, session: Session) -> None:
        """Queue a point. At a new shape, when the waiting points hold more than the budget,
        time them first (a block): memory stays bounded while shapes keep their rounds."""
        if self.sessions and session.key != self.sessions[-1].key and \
                self.held + session.nbytes > budget_bytes(session.point):
            self.run()
        self.sessions.append(session)
        self.held += session.nbytes

    def run(self) -> None:
        sessions, self.sessions, self.held = self.sessions, [], 0
        if sessions:
            run_rounds(sessions, self.say, self.on_visit, self.stop)


def budget_bytes(point: Point) -> float:
    """``timing.resident_mb``, or a quarter of the device's memory (the rest is for the calls)."""
    if point.timing.resident_mb is not None:
        return point.timing.resident_mb * 2**20
    if point.device.startswith("cuda"):
        return torch.cuda.get_device_properties(point.device).total_memory / 4
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 4
    except (ValueError, OSError, AttributeError):
        return 4 * 2**30

