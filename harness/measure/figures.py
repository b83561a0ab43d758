"""What a point's rounds found (``Timed``): its timing and contention parts of the record
(harness/schema_timing.py), from its repetitions (a ``Session``'s samples), and what the re-check
after them found. docs/methodology.md, "How a point is timed".

The latency is the trimmed geometric mean over the rounds of each round's median call, with its
interval (``stats.rounds_interval``); the speedup over nn.MultiheadAttention is paired round by
round (a pair is two repetitions of the same round of the same run: resumed rounds never pair
across runs); on CUDA with a graph, the eager call's time and speedup beside them; on the CPU
with one thread, from the timed thread's CPU time (``Session.method``), the wall time beside it.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from harness import envinfo
from harness.config import Point, rerun_floor
from harness.measure import clocks, contention, stats
from harness.measure.session import Session, min_clean
from harness.measure.timing import quantiles
from harness.schema_timing import Contention, Timing

# timing.max_noise=null: target relative half-width. Above the floor that the between-run term
# puts under every interval (sinh(1.96 x floor); config.rerun_floor).
DEFAULT_NOISE = {"cuda": 0.10, "cpu": 0.10}
# The CPU's two clocks: a way timed by one pairs with a reference timed by the other on the wall
# time both have (a way resumed from a run before the CPU clock, say).
HOST = {"cpu", "wall"}


def max_noise(point: Point) -> float:
    if point.timing.max_noise is not None:
        return point.timing.max_noise
    return DEFAULT_NOISE["cuda" if point.device.startswith("cuda") else "cpu"]


@dataclass(frozen=True)
class Timed:
    """A point's rounds, as its record takes them."""

    timing: Timing
    contention: Contention
    # the re-check after the rounds found the timed call's output changed: why (a mismatch), or
    # None (the same output, or not re-checked: harness/way/recheck.py)
    changed: str | None = None

    def columns(self) -> dict:
        """The two parts' columns, as a row has them."""
        return {**self.timing.columns(), **self.contention.columns()}


def timed(session: Session, reference: Session | None, floor: float | None = None) -> Timed:
    """What ``session``'s rounds found, paired with ``reference`` (nn.MHA at its shape; None:
    none). ``floor``: the between-run floor measured from the shape's rounds
    (``stats.drift_floor``), which may only widen the earned one where ``timing.rerun_noise`` is
    null (``config.rerun_floor``)."""
    s, point = session, session.point
    every = sorted(s.by_round().values(), key=lambda x: x.round)
    # Clean rounds only (paired with a clean round of the reference); with too few, it stayed
    # contended: its intervals are what was measured; it decides nothing (report/busy.py).
    clean = s.clean(None if s.reference else reference)
    contended = s.stayed_contended(reference)
    own = s.clean()  # where only the reference was spoiled, this point's own are clean
    kept = (own if len(own) >= min_clean(point) else every) if contended else clean
    timed_by, field = s.method()
    ms = [getattr(x, field) for x in kept]
    if point.timing.rerun_noise is not None:
        floor, floor_from = point.timing.rerun_noise, "config"
    else:  # earned from re-runs, widened by what the rounds measured
        floor, floor_from = rerun_floor(point.device, floor)
    latency = stats.rounds_interval(ms, floor)
    speedup = paired(s, kept, reference, "ms", floor)
    # the CPU clock decided: the wall time over the same rounds beside it (Google Benchmark's
    # "Time" beside its "CPU")
    wall = stats.rounds_interval([x.ms for x in kept], floor) if field != "ms" and kept else None
    is_paired = not s.reference and not math.isnan(speedup.center)
    noise = speedup.rel_halfwidth if is_paired else latency.rel_halfwidth
    q = quantiles(ms) if ms else [math.nan] * 5
    times = [x.at for x in kept]
    eager = eager_speedup = warm = None
    if s.eager_sample is not None or any(x.eager_ms is not None for x in kept):
        eager = stats.rounds_interval([x.eager_ms for x in kept], floor)
        eager_speedup = paired(s, kept, reference, "eager_ms", floor)
    if any(x.warm_ms is not None for x in kept):
        warm = stats.rounds_interval([x.warm_ms for x in kept], floor).center
    timing = Timing(
        timing_state="done" if len(every) >= point.timing.rounds else "partial",
        latency=latency,
        speedup=speedup,
        timed_by=timed_by,
        wall_ms_median=None if wall is None else _num(wall.center),
        graph_error=s.graph_error,
        eager=eager,
        replay_warm_ms_median=_num(warm),
        eager_speedup=eager_speedup,
        latency_ms_iqr=q[3] - q[1],
        latency_ms_p10=q[0],
        latency_ms_p90=q[4],
        host_ms_per_call=s.host_ms,
        launch_ms_per_call=statistics.median(s.launches) if s.launches else None,
        **clocks.columns(s.clocks),
        n_samples=len(ms),
        calls_per_round=s.calls,
        rounds_span_s=max(times) - min(times) if times else None,
        noise=noise,
        noise_target_met=bool(noise <= max_noise(point)),
        rerun_noise=floor,
        rerun_noise_from=floor_from,
        timing_s=s.setup_s + s.spent_s,
        recompiles=s.recompiles + sum(x.recompiles for x in kept),
        **s.leak_columns(),
    )
    seen = contention.columns(s.seen, s.spoiled, envinfo.available_cores())
    spoiled = sum(1 for x in every if x.contended)
    part = Contention(contended=contended, contended_rounds=spoiled, **seen)
    return Timed(timing, part, s.changed)


def paired(s: Session, kept: list, reference: Session | None, field: str, floor: float):
    """nn.MultiheadAttention's time over this point's, paired round by round, of the samples'
    ``field`` (``ms``: the timed figure; ``eager_ms``: the eager call's), like for like: where
    one side's timed figure is a graph's replay and the other's an eager call between events
    (a failed capture), the timed figures are not paired (NaN) and the eager ones are (an
    events-timed side's timed figure is its eager call)."""
    if s.reference:
        return stats.Interval(1.0, 1.0, 1.0, len(kept)) if kept else stats.NAN
    if reference is None or not reference.samples:
        return stats.NAN
    methods = {reference.method()[0], s.method()[0]}
    if field == "ms" and len(methods) > 1 and not methods <= HOST:
        return stats.NAN  # a device time against an eager call time
    host_wall = len(methods) > 1  # one side lacks the CPU clock's figure: both by the wall clock

    def figure(session: Session) -> str:
        if field == "ms":
            return "ms" if host_wall else session.method()[1]  # the CPU clock's where it decides
        return "ms" if field == "eager_ms" and session.timed_by == "events" else field

    mine, other = figure(s), figure(reference)
    theirs = {(x.run, x.round): getattr(x, other) for x in reference.samples}
    pairs = [
        (theirs[(x.run, x.round)], getattr(x, mine)) for x in kept if (x.run, x.round) in theirs
    ]
    pairs = [(a, b) for a, b in pairs if a is not None and b is not None]
    return stats.paired_ratio([a for a, _ in pairs], [b for _, b in pairs], floor)


def _num(x: float | None):
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else x
