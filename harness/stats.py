"""Intervals from repetitions: what a figure is worth on a machine whose speed drifts.

Every interval here is computed from the spread *between* repetitions that were spread over the
sweep (rounds), never from the calls inside one repetition: on a shared machine speed drifts by
10-25% over minutes while each short window looks quiet, so a within-window spread is far too
small (DESIGN.md, "Measurement you can act on").

Timings are positive and their noise multiplicative, so intervals are built on logarithms:
centre = the median of the values, half-width = t(0.975, n-1) * 1.2533 * sd(log values) / sqrt(n)
(1.2533 * sd / sqrt(n) is the standard error of a median), mapped back with exp. A paired
speedup is the same interval over per-round ratios (reference time / way time in the same
round), which cancels drift that both sides of a pair see.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Sequence

# Two-sided 95% quantiles of Student's t for 1..30 degrees of freedom.
_T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
         2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
         2.052, 2.048, 2.045, 2.042]
MEDIAN_SE = 1.2533  # standard error of a median = 1.2533 * sigma / sqrt(n) (normal data)


def t975(df: int) -> float:
    """Student's t quantile for a two-sided 95% interval (Cornish-Fisher beyond the table)."""
    if df < 1:
        return math.inf
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959964
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


@dataclass(frozen=True)
class Interval:
    center: float  # the median of the values
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


def log_interval(values: Sequence[float]) -> Interval:
    """Median of positive values with a 95% interval from the spread between them."""
    logs = [math.log(v) for v in values if v is not None and v > 0 and math.isfinite(v)]
    n = len(logs)
    if n == 0:
        return NAN
    center = statistics.median(logs)
    if n < 2:
        return Interval(math.exp(center), math.nan, math.nan, n)
    half = t975(n - 1) * MEDIAN_SE * statistics.stdev(logs) / math.sqrt(n)
    return Interval(math.exp(center), math.exp(center - half), math.exp(center + half), n)


def paired_ratio(numerators: Sequence[float], denominators: Sequence[float]) -> Interval:
    """Interval of numerator / denominator over pairs measured side by side (same round)."""
    return log_interval([a / b for a, b in zip(numerators, denominators) if a and b])


def log_halfwidth(iv_low: float, iv_high: float) -> float:
    """Half-width of an interval on the log scale (how ratios of two intervals combine)."""
    if not (iv_low and iv_high) or iv_low <= 0 or iv_high <= 0:
        return math.inf
    return (math.log(iv_high) - math.log(iv_low)) / 2


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
