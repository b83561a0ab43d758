"""The earned between-run floor: what a re-run adds that one run's rounds cannot see, per device
kind, measured from re-runs and stored with its date and machine (``harness/floors.json``).

Every interval adds a between-run relative sd, the floor, in quadrature (harness/measure/stats.py):
half-width (on logs) = sqrt((t * sd / sqrt(n))^2 + (1.96 * floor)^2). Where that floor comes from:

- **earned**: ``make stability`` (on the CPU) or ``make gpu-check STEP=stability`` (on a GPU)
  runs one sweep twice and measures the spread of the speedups between the two runs beyond what
  the rounds of each run saw. What is stored is not that point estimate (from ~24 points it is
  too small about half the time) but its upper confidence bound (``CONFIDENCE``, one-sided):
  ``from_reruns``. Each re-run pair's differences are kept (``Rerun``) and pooled with the
  machine's earlier ones (the last ``MAX_RUNS``, ``earn``): every pair adds degrees of freedom,
  so the bound comes closer to the spread it bounds.
- **rounds**: a floor measured inside one run (``stats.drift_floor``: the drift between the
  first and second halves of a shape's rounds) may only widen it. Alone it has about one degree
  of freedom per shape (every way at a shape shares the drift): 0 in about half the runs.
- **assumed**: no earned floor for the device kind: the assumed constant, widened by the
  in-run measurement where it is larger.

``floor_rule`` says which applies. Ground module: stdlib only, it imports nothing of the harness.
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import tempfile
from dataclasses import asdict, dataclass
from datetime import date
from pathlib import Path
from typing import Sequence

PATH = Path(__file__).with_name("floors.json")
KINDS = ("cpu", "cuda")
SOURCES = ("earned", "rounds", "assumed")
CONFIDENCE = 0.90  # one-sided: the stored floor is at least the true between-run sd this often
MIN_POINTS = 3  # re-run differences an estimate needs
MAX_RUNS = (
    5  # re-run pairs pooled into one floor: older ones are dropped, so it follows the machine
)


@dataclass(frozen=True)
class Rerun:
    """One re-run pair's evidence (``make stability``'s runs A and B): per point, d =
    log(speedup_B / speedup_A), the variance of d its rounds predict, and its shape's number."""

    measured: str  # ISO date
    d: tuple[float, ...]
    within: tuple[float, ...]
    shapes: tuple[int, ...]  # points of one shape share their reference's offset

    def entry(self) -> dict:
        return {
            "measured": self.measured,
            "d": [round(x, 7) for x in self.d],
            "within": [float(f"{w:.4g}") for w in self.within],
            "shapes": list(self.shapes),
        }


@dataclass(frozen=True)
class Floor:
    """One device kind's earned floor (an entry of floors.json)."""

    value: float  # the floor intervals use: the upper bound (``rerun_noise`` in the file)
    measured: str  # ISO date of the re-runs
    machine: str  # what ran them: the CPU model and its cores, or the GPU
    by: str  # the command that measured it (and where its figures are written up)
    points: int | None = None  # re-run differences behind it
    estimate: float | None = None  # the point estimate
    upper: float | None = None  # its upper confidence bound (CONFIDENCE)
    reruns: tuple[Rerun, ...] = ()  # the re-run pairs pooled into it, oldest first

    def entry(self) -> dict:
        """The floors.json entry (``value`` is stored as ``rerun_noise``)."""
        out = {"rerun_noise": self.value, **asdict(self)}
        del out["value"]
        out["reruns"] = [r.entry() for r in self.reruns]
        if not self.reruns:
            del out["reruns"]
        return out


def kind_of(device: str) -> str:
    """The device kind a floor is stored under: ``cuda:1`` -> ``cuda``."""
    kind = str(device).split(":", 1)[0].strip().lower()
    if kind not in KINDS:
        raise ValueError(f"no floor is kept for device kind {device!r} (kinds: {', '.join(KINDS)})")
    return kind


def _fraction(name: str, x, none_ok: bool = True) -> float | None:
    if x is None and none_ok:
        return None
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not (0 <= x < 1):
        raise ValueError(f"{name} must be a fraction between 0 and 1, not {x!r}")
    return float(x)


def _floor(kind: str, entry) -> Floor:
    where = f"{PATH.name}: {kind}"
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: an entry is an object, not {entry!r}")
    missing = {"rerun_noise", "measured", "machine", "by"} - set(entry)
    if missing:
        raise ValueError(f"{where}: missing {', '.join(sorted(missing))}")
    value = _fraction(f"{where}.rerun_noise", entry["rerun_noise"], none_ok=False)
    try:
        date.fromisoformat(str(entry["measured"]))
    except ValueError:
        raise ValueError(f"{where}.measured must be an ISO date, not {entry['measured']!r}")
    points = entry.get("points")
    if points is not None and (isinstance(points, bool) or not isinstance(points, int)):
        raise ValueError(f"{where}.points must be an integer, not {points!r}")
    return Floor(
        value=value,
        measured=str(entry["measured"]),
        machine=str(entry["machine"]),
        by=str(entry["by"]),
        points=points,
        estimate=_fraction(f"{where}.estimate", entry.get("estimate")),
        upper=_fraction(f"{where}.upper", entry.get("upper")),
        reruns=tuple(
            _rerun(f"{where}.reruns[{i}]", r) for i, r in enumerate(entry.get("reruns", ()))
        ),
    )


def _rerun(where: str, entry) -> Rerun:
    try:
        rerun = Rerun(
            measured=str(entry["measured"]),
            d=tuple(float(x) for x in entry["d"]),
            within=tuple(float(w) for w in entry["within"]),
            shapes=tuple(int(g) for g in entry["shapes"]),
        )
        date.fromisoformat(rerun.measured)
    except (TypeError, KeyError, ValueError) as e:
        raise ValueError(f"{where}: a re-run is {{measured, d, within, shapes}} ({e!r})") from None
    if not len(rerun.d) == len(rerun.within) == len(rerun.shapes):
        raise ValueError(f"{where}: d, within and shapes are per point: one length")
    if (
        not all(math.isfinite(x) for x in rerun.d + rerun.within)
        or min(rerun.within, default=0) < 0
    ):
        raise ValueError(f"{where}: d must be finite and within finite and >= 0")
    return rerun


_cache: dict[tuple, dict[str, Floor]] = {}


def load(path: str | os.PathLike = PATH) -> dict[str, Floor]:
    """Every stored floor by device kind ({} without a file). A damaged file raises ValueError."""
    path = Path(path)
    try:
        st = path.stat()
    except FileNotFoundError:
        return {}
    key = (str(path.resolve()), st.st_mtime_ns, st.st_size)
    if key not in _cache:
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON ({e})") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path}: an object of device kinds, not {type(data).__name__}")
        unknown = set(data) - set(KINDS)
        if unknown:
            raise ValueError(f"{path}: unknown device kinds {sorted(unknown)} (kinds: {KINDS})")
        _cache.clear()
        _cache[key] = {k: _floor(k, v) for k, v in data.items()}
    return dict(_cache[key])


def earned(kind: str, path: str | os.PathLike = PATH) -> Floor | None:
    """The earned floor of a device kind (``cpu``, ``cuda``; ``cuda:0`` reads as ``cuda``), or
    None when none was measured and stored."""
    return load(path).get(kind_of(kind))


def floor_rule(earned: float | None, in_run: float | None, assumed: float) -> tuple[float, str]:
    """The floor an interval uses, and where it comes from (``SOURCES``):

    - ``earned``: the floor earned from re-runs (``earned(kind).value``) applies;
    - ``rounds``: the floor measured inside this run (``stats.drift_floor``) is larger, and
      widens it; it never narrows an earned or assumed one;
    - ``assumed``: nothing was earned: the assumed constant (unless the in-run one is larger).

    None (or NaN) for ``earned`` or ``in_run``: not available."""
    for name, x in (("earned", earned), ("in_run", in_run)):
        if x is not None and not (isinstance(x, (int, float)) and (x >= 0 or math.isnan(x))):
            raise ValueError(f"floor_rule: {name} must be >= 0 or None, not {x!r}")
    if not (isinstance(assumed, (int, float)) and assumed >= 0):
        raise ValueError(f"floor_rule: assumed must be >= 0, not {assumed!r}")
    in_run = None if in_run is None or math.isnan(in_run) else float(in_run)
    if earned is None or math.isnan(earned):
        base, source = float(assumed), "assumed"
    else:
        base, source = float(earned), "earned"
    if in_run is not None and in_run > base:
        return in_run, "rounds"
    return base, source


def chi2_quantile(p: float, df: float) -> float:
    """The p quantile of the chi-square distribution with ``df`` degrees of freedom (Wilson and
    Hilferty's cube-root normal approximation: within 1.5% at df >= 3, 0.3% at df >= 10, in
    the tails used here)."""
    if not 0 < p < 1 or df <= 0:
        raise ValueError(f"chi2_quantile: p in (0, 1) and df > 0, not p={p!r}, df={df!r}")
    z = statistics.NormalDist().inv_cdf(p)
    c = 2 / (9 * df)
    return df * max(0.0, 1 - c + z * math.sqrt(c)) ** 3


def from_reruns(
    d: Sequence[float],
    within_var: Sequence[float],
    confidence: float = CONFIDENCE,
    groups: Sequence | None = None,
) -> tuple[float, float]:
    """The between-run floor from a re-run: ``(estimate, upper)``.

    ``d``: per point, d_i = log(speedup_B / speedup_A) of the same point in two runs;
    ``within_var``: per point, the variance of d_i that the two runs' rounds predict,
    se_A^2 + se_B^2 (each se = the half-width with the floor taken out, over t(0.975, n-1)).

    Model: d_i ~ N(0, 2 sigma^2 + w_i), independent, where sigma is the floor (each run adds
    sigma^2 that its rounds cannot see). The differences are taken about 0, not about their
    mean: a shift shared by every point (nn.MHA slower in one run) is what a re-run moves too.
    Estimate: sigma^2 = (mean d^2 - mean w) / 2, never below 0 (the moment estimate). Upper
    bound: Q(sigma) = sum d_i^2 / (2 sigma^2 + w_i) is chi-square with k degrees of freedom at
    the true sigma and falls as sigma grows, so the one-sided ``confidence`` bound is the sigma
    at which Q equals chi2's (1 - confidence) quantile (0 when even sigma = 0 is below it: the
    rounds alone over-explain the differences). (NaN, NaN) with fewer than MIN_POINTS points.

    ``groups``: per point, its shape. The speedups of the ways at one shape share their
    reference's run-to-run offset, so their d_i are correlated (about 0.5 with three ways) and
    carry fewer than k degrees of freedom; without ``groups`` the bound then covers the true
    sigma less often than ``confidence`` (0.85 instead of 0.90 for 8 shapes of 3 ways,
    tests/test_floor_coverage.py). With them, Q is taken as a scaled chi-square with the
    Satterthwaite degrees of freedom k_eff = k^2 / (k + sum over shapes of m(m-1) rho^2), rho the
    correlation within a shape estimated from the d_i (about 0, clipped to [0, 1])."""
    if groups is None:
        groups = range(len(d))  # every point its own group: independent
    if not len(d) == len(within_var) == len(groups):
        raise ValueError("from_reruns: d, within_var and groups are per point: one length")
    pairs = [
        (float(x), max(0.0, float(w)), g)
        for x, w, g in zip(d, within_var, groups)
        if x is not None and w is not None and math.isfinite(x) and math.isfinite(w)
    ]
    k = len(pairs)
    if k < MIN_POINTS:
        return math.nan, math.nan
    if not 0 < confidence < 1:
        raise ValueError(f"from_reruns: confidence in (0, 1), not {confidence!r}")
    d2 = [x * x for x, _, _ in pairs]
    within = statistics.fmean(w for _, w, _ in pairs)
    estimate = math.sqrt(max(0.0, statistics.fmean(d2) - within) / 2)
    k_eff = _effective_dof([(x, g) for x, _, g in pairs])
    q = chi2_quantile(1 - confidence, k_eff) * k / k_eff

    def Q(var: float) -> float:
        total = 0.0
        for x2, (_, w, _) in zip(d2, pairs):
            if x2 > 0:
                spread = 2 * var + w
                if spread <= 0:
                    return math.inf
                total += x2 / spread
        return total

    if q <= 0 or Q(0.0) <= q:
        return estimate, estimate  # the bound is 0; never below the point estimate
    lo, hi = 0.0, sum(d2) / (2 * q)  # Q(hi) <= sum d^2 / (2 hi) = q
    for _ in range(200):
        mid = (lo + hi) / 2
        if Q(mid) > q:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-12 * hi:
            break
    return estimate, max(estimate, math.sqrt(hi))


def _effective_dof(points: list[tuple[float, object]]) -> float:
    """Degrees of freedom of sum d_i^2 when the d_i of one group are correlated (Satterthwaite:
    Var(sum d^2) = 2 v^2 (k + sum m(m-1) rho^2) for m points a group, correlation rho)."""
    k = len(points)
    by: dict = {}
    for x, g in points:
        by.setdefault(g, []).append(x)
    pairs = sum(len(xs) * (len(xs) - 1) // 2 for xs in by.values())
    if not pairs:
        return float(k)
    cross = sum(a * b for xs in by.values() for i, a in enumerate(xs) for b in xs[i + 1 :])
    var = sum(x * x for x, _ in points) / k
    rho = min(1.0, max(0.0, cross / pairs / var)) if var > 0 else 0.0
    return k * k / (k + 2 * pairs * rho * rho)


def pooled(reruns: Sequence[Rerun], confidence: float = CONFIDENCE) -> tuple[float, float, int]:
    """``from_reruns`` over every point of ``reruns`` (a shape of one pair is a group of its
    own: pairs are independent re-runs): (estimate, upper, points)."""
    d = [x for r in reruns for x in r.d]
    within = [w for r in reruns for w in r.within]
    groups = [(i, g) for i, r in enumerate(reruns) for g in r.shapes]
    estimate, upper = from_reruns(d, within, confidence, groups)
    return estimate, upper, len(d)


def earn(
    kind: str,
    rerun: Rerun,
    machine: str,
    by: str,
    fresh: bool = False,
    path: str | os.PathLike = PATH,
) -> Floor:
    """Store the floor earned by ``rerun`` pooled with the re-runs already stored for the same
    device kind and machine (the last ``MAX_RUNS`` in all; none with ``fresh``, or when the
    stored floor was earned on another machine, whose spread says nothing of this one)."""
    rerun = _rerun("earn", rerun.entry())  # pooled as stored
    before = None if fresh else load(path).get(kind_of(kind))
    kept = before.reruns if before is not None and before.machine == str(machine) else ()
    reruns = (*kept, rerun)[-MAX_RUNS:]
    estimate, upper, points = pooled(reruns)
    if not math.isfinite(upper):
        raise ValueError(
            f"earn: {points} points measured in both runs: at least {MIN_POINTS} earn a floor"
        )
    return store(
        kind, upper, machine, by, points, estimate, upper, path, rerun.measured, reruns=reruns
    )


def _compact(text: str) -> str:
    """JSON with each list of numbers on one line (a re-run's points: a line, not a page)."""
    return re.sub(
        r"\[\s*(-?[\d.e+-]+(?:,\s*-?[\d.e+-]+)*)\s*\]",
        lambda m: "[" + ", ".join(x.strip() for x in m.group(1).split(",")) + "]",
        text,
    )


def store(
    kind: str,
    value: float,
    machine: str,
    by: str,
    points: int | None = None,
    estimate: float | None = None,
    upper: float | None = None,
    path: str | os.PathLike = PATH,
    measured: str | None = None,
    reruns: Sequence[Rerun] = (),
) -> Floor:
    """Write one device kind's earned floor into floors.json (the other kinds kept), atomically
    (a temporary file in the same folder, then os.replace). ``value`` is rounded up to 4
    decimals (rounding never narrows it); ``measured`` defaults to today."""
    kind = kind_of(kind)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"store: the floor must be a number, not {value!r}")
    floor = Floor(
        value=_fraction("rerun_noise", math.ceil(value * 1e4 - 1e-9) / 1e4, none_ok=False),
        measured=measured or date.today().isoformat(),
        machine=str(machine),
        by=str(by),
        points=None if points is None else int(points),
        estimate=None if estimate is None else round(float(estimate), 5),
        upper=None if upper is None else round(float(upper), 5),
        reruns=tuple(_rerun("store", r.entry()) for r in reruns),  # as it reads back
    )
    _floor(kind, floor.entry())  # what is written reads back
    path = Path(path)
    every = {k: f.entry() for k, f in load(path).items()}
    every[kind] = floor.entry()
    every = {k: every[k] for k in KINDS if k in every}
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(_compact(json.dumps(every, indent=2)) + "\n")
        os.chmod(tmp, path.stat().st_mode & 0o777 if path.exists() else 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return floor
