"""Intervals from repetitions: what a figure is worth on a machine whose speed drifts.

Every interval here is computed from the spread *between* repetitions that were spread over the
sweep (rounds), never from the calls inside one repetition: on a shared machine speed drifts by
10-25% over minutes while each short window looks quiet, so a within-window spread is far too
small (docs/architecture.md, "Measurement you can act on").

Timings are positive and their noise multiplicative, so intervals are built on logarithms and
mapped back with exp. Over the rounds of one point (``rounds_interval``, ``paired_ratio``) the
centre is the 20%-trimmed mean of the logs and the interval Yuen's (Student's t over the
winsorized spread, with the trimmed count's degrees of freedom): on a shared VM a repetition is
now and then slowed by what no probe sees (another guest on the host), and one such round in 11
moved a plain mean and doubled its interval; the trimmed mean discounts up to 2 of 11 rounds at
either end, and a point whose rounds are disturbed throughout still gets a wide interval. With
fewer than 5 rounds nothing is trimmed. Summaries over pairs of ways (``log_interval``) keep
the plain geometric mean: there every value is a different measurement, not a repeat. (Each
round's value is already a median of one repetition's calls, so a preempted call does not
reach it.) A paired speedup is the interval over per-round ratios (reference time / way time in
the same round), which cancels drift that both sides of a pair see.

What the rounds of one run cannot see: conditions that last longer than the run (a neighbour's
job for minutes) and the state of the process itself. Two runs of the same sweep differ by that
too, so an interval meant to cover a re-run adds it in quadrature: ``floor``, a relative
standard deviation between runs (``timing.rerun_noise``; ``make stability`` measures it). It is
a fixed term of the model, not estimated from the rounds, so it takes the normal quantile:
half-width = sqrt((t(0.975, df) * se)^2 + (1.96 * floor)^2).
"""

from __future__ import annotations

import math
import statistics
from typing import Sequence

from harness.column import NAN, Interval  # noqa: F401 (re-exported: the intervals' type)

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


# The share of the rounds trimmed from each end (Wilcox's usual 20%): at the default 11 rounds,
# 2 from each end; fewer than 5 rounds trim none (the plain mean and Student's t).
TRIM = 0.2


def rounds_df(n: int) -> int:
    """Degrees of freedom of ``rounds_interval`` over ``n`` rounds (n - 2k - 1, k trimmed)."""
    return n - 2 * int(TRIM * n) - 1


def rounds_interval(values: Sequence[float], floor: float = 0.0) -> Interval:
    """The interval of one point's rounds: the 20%-trimmed mean of the logs with Yuen's 95%
    interval (Student's t with n - 2k - 1 degrees of freedom over the winsorized variance,
    se^2 = (n - 1) s_w^2 / (h (h - 1)), h = n - 2k), widened by the between-run ``floor``. With
    nothing trimmed it is ``log_interval``'s."""
    logs = sorted(math.log(v) for v in values if v is not None and v > 0 and math.isfinite(v))
    n = len(logs)
    k = int(TRIM * n)
    if k == 0:
        return log_interval(values, floor)
    h = n - 2 * k
    center = statistics.fmean(logs[k : n - k])
    winsorized = [logs[k]] * k + logs[k : n - k] + [logs[n - k - 1]] * k
    se = math.sqrt((n - 1) * statistics.variance(winsorized) / (h * (h - 1)))
    half = math.hypot(t975(rounds_df(n)) * se, Z975 * floor)
    return Interval(math.exp(center), math.exp(center - half), math.exp(center + half), n)


def paired_ratio(
    numerators: Sequence[float], denominators: Sequence[float], floor: float = 0.0
) -> Interval:
    """Interval of numerator / denominator over pairs measured side by side (same round)."""
    return rounds_interval([a / b for a, b in zip(numerators, denominators) if a and b], floor)


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
