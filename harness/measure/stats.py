"""Intervals from repetitions: what a figure is worth on a machine whose speed drifts.

Every interval here is computed from the spread *between* repetitions that were spread over the
sweep (rounds), never from the calls inside one repetition: on a shared machine speed drifts by
10-25% over minutes while each short window looks quiet, so a within-window spread is far too
small (docs/architecture.md, "Measurement you can act on").

Timings are positive and their noise multiplicative, so intervals are built on logarithms: a
Student-t interval of the mean log, mapped back with exp. The centre is the geometric mean of
the values, the half-width t(0.975, n-1) * sd(log values) / sqrt(n). (Each value is already a
median of one repetition's calls, so a preempted call does not reach it; a disturbed round
widens the interval through the sd, which is what an honest interval should do.) A paired
speedup is the same interval over per-round ratios (reference time / way time in the same
round), which cancels drift that both sides of a pair see.

What the rounds of one run cannot see: conditions that last longer than the run (a neighbour's
job for minutes) and the state of the process itself. Two runs of the same sweep differ by that
too, so an interval meant to cover a re-run adds it in quadrature: ``floor``, a relative
standard deviation between runs (``timing.rerun_noise``; ``make stability`` measures it). It is
a fixed term of the model, not estimated from the rounds, so it takes the normal quantile:
half-width = sqrt((t(0.975, n-1) * sd / sqrt(n))^2 + (1.96 * floor)^2).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Sequence

# Two-sided 95% quantiles of Student's t for 1..30 degrees of freedom.
_T975 = [
    12.706,
    4.303,
    3.182,
    2.776,
    2.571,
    2.447,
    2.365,
    2.306,
    2.262,
    2.228,
    2.201,
    2.179,
    2.160,
    2.145,
    2.131,
    2.120,
    2.110,
    2.101,
    2.093,
    2.086,
    2.080,
    2.074,
    2.069,
    2.064,
    2.060,
    2.056,
    2.052,
    2.048,
    2.045,
    2.042,
]


Z975 = 1.959964  # two-sided 95% quantile of the normal distribution


def t975(df: int) -> float:
    """Student's t quantile for a two-sided 95% interval (Cornish-Fisher beyond the table)."""
    if df < 1:
        return math.inf
    if df <= len(_T975):
        return _T975[df - 1]
    z = Z975
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


@dataclass(frozen=True)
class Interval:
    center: float  # the geometric mean of the values
    low: float  # 95% interval (NaN with fewer than 2 values)
    high: float
    n: int

    @property
    def rel_halfwidth(self) -> float:
        """Half the interval's width relative to its centre (0.05 = ±5%)."""
        if not self.center or math.isnan(self.low):
            return math.inf
        return (self.high - self.low) / 2 / self.center

    def overlaps(self, other: "Interval") -> bool:
        return self.low <= other.high and other.low <= self.high


NAN = Interval(math.nan, math.nan, math.nan, 0)


def log_interval(values: Sequence[float], floor: float = 0.0) -> Interval:
    """Geometric mean of positive values with a 95% interval from the spread between them,
    widened by a between-run relative standard deviation ``floor``."""
    logs = [math.log(v) for v in values if v is not None and v > 0 and math.isfinite(v)]
    n = len(logs)
    if n == 0:
        return NAN
    center = statistics.fmean(logs)
    if n < 2:
        return Interval(math.exp(center), math.nan, math.nan, n)
    half = math.hypot(t975(n - 1) * math.sqrt(statistics.variance(logs) / n), Z975 * floor)
    return Interval(math.exp(center), math.exp(center - half), math.exp(center + half), n)


def paired_ratio(
    numerators: Sequence[float], denominators: Sequence[float], floor: float = 0.0
) -> Interval:
    """Interval of numerator / denominator over pairs measured side by side (same round)."""
    return log_interval([a / b for a, b in zip(numerators, denominators) if a and b], floor)


def log_halfwidth(iv_low: float, iv_high: float) -> float:
    """Half-width of an interval on the log scale (how ratios of two intervals combine)."""
    if not (iv_low and iv_high) or iv_low <= 0 or iv_high <= 0:
        return math.inf
    return (math.log(iv_high) - math.log(iv_low)) / 2


def pooled(intervals: Sequence[tuple[float, float, float]], floor: float = 0.0) -> Interval:
    """Geometric mean of ratios measured each with its own 95% interval (centre, low, high), each
    including the re-run ``floor``: the mean over these measurements, not over a population they
    are drawn from. Their log half-widths, the floor taken out, add in quadrature (independent
    measurements) over their number; the floor, which moves every one of them together in a
    re-run, is put back once. NaN bounds when one of them has no interval."""
    logs = [math.log(c) for c, _, _ in intervals if c and c > 0 and math.isfinite(c)]
    n = len(logs)
    if n == 0 or n != len(intervals):
        return NAN
    center = statistics.fmean(logs)
    spread = [log_halfwidth(low, high) for _, low, high in intervals]
    if not all(math.isfinite(h) for h in spread):
        return Interval(math.exp(center), math.nan, math.nan, n)
    own = [max(h * h - (Z975 * floor) ** 2, 0.0) for h in spread]
    half = math.hypot(math.sqrt(sum(own)) / n, Z975 * floor)
    return Interval(math.exp(center), math.exp(center - half), math.exp(center + half), n)


def ratio_of_intervals(a: tuple[float, float, float], b: tuple[float, float, float]) -> Interval:
    """b / a for two independent intervals given as (centre, low, high): the log half-widths
    add in quadrature (two runs are independent measurements)."""
    ca, cb = a[0], b[0]
    if not (ca and cb) or ca <= 0 or cb <= 0:
        return NAN
    center = cb / ca
    half = math.hypot(log_halfwidth(a[1], a[2]), log_halfwidth(b[1], b[2]))
    if not math.isfinite(half):
        return Interval(center, math.nan, math.nan, 2)
    return Interval(center, center * math.exp(-half), center * math.exp(half), 2)


# Rounds each half of a point's series needs for ``drift_floor`` to read it, and points a shape
# needs: fewer, and the drift is not measured (the configured or assumed floor applies).
DRIFT_MIN_HALF = 2
DRIFT_MIN_SERIES = 2


def drift_floor(series: Sequence[Sequence[float]]) -> float | None:
    """The between-run floor measured from one run's rounds (``timing.rerun_noise=null`` on CUDA):
    each series is one point's values in round order (every way at one shape, its reference
    included). Within a series the first half's mean log differs from the second half's by d; if
    each half saw an offset of its own with relative sd ``sigma`` (conditions that last longer
    than a round: clocks, heat, a neighbour), E[d^2] = 2 sigma^2 + what the spread within the
    halves predicts. Pooled over the series: sigma^2 = (mean d^2 - mean predicted) / 2, never
    below 0. A shape whose rounds drift gets a floor that covers that drift; a steady one gets
    the narrow interval its repetitions allow. None when there are too few series or rounds."""
    d2, predicted = [], []
    for values in series:
        logs = [math.log(v) for v in values if v is not None and v > 0 and math.isfinite(v)]
        half = len(logs) // 2
        first, second = logs[:half], logs[len(logs) - half :]
        if half < DRIFT_MIN_HALF:
            continue
        var = (statistics.variance(first) + statistics.variance(second)) / 2
        d2.append((statistics.fmean(first) - statistics.fmean(second)) ** 2)
        predicted.append(2 * var / half)
    if len(d2) < DRIFT_MIN_SERIES:
        return None
    return math.sqrt(max(0.0, statistics.fmean(d2) - statistics.fmean(predicted)) / 2)
