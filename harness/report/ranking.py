"""Winners or honest ties: one row per shape, from the rows' intervals (``ranking.csv``).

At every shape (every configuration key but the way of writing it: SHAPE_KEYS), among the
correct timed ways (status ok), the best is the one with the highest speedup over
nn.MultiheadAttention (paired in the same rounds, so drift cancels); its contenders are every
way whose 95% interval overlaps the best's, best first. The winner is named only when the best's
interval clears every other way's; otherwise the shape is a tie between its contenders. A tie
whose contenders are exactly the ways that share some factors (every fused QKV with SDPA, its
view and reshape merges tied: they run the same kernels) still answers the question: those
factors win (``winner_factors``), and the ones the contenders differ in do not matter there
(``tied_factors``). A shape
with no speedup (its reference failed) is ranked by latency intervals instead (``basis``).
A way whose interval could not be computed (fewer than 2 rounds) cannot be ruled out: it is
always a contender. A shape where any correct timed way stayed contended by other processes
(``contended``: harness/report/busy.py) names no winner and no winning factors: ``busy`` counts
those ways, and its best and contenders are what was measured, nothing more.
"""

from __future__ import annotations

import math

import pandas as pd

from harness.progress import case
from harness.report.busy import flag
from harness.results import SHAPE_KEYS, factors, number, timed_ok, way

RANKING_FILE = "ranking.csv"
COLUMNS = [
    *SHAPE_KEYS,
    "shape",
    "basis",
    "winner",
    "contenders",
    "best",
    "n_ways",
    "best_speedup",
    "best_speedup_ci_low",
    "best_speedup_ci_high",
    "best_latency_ms",
    "best_latency_ms_ci_low",
    "best_latency_ms_ci_high",
    "best_noise_target_met",
    "winner_factors",
    "tied_factors",
    "busy",
]


def shape_keys(df: pd.DataFrame) -> list[str]:
    return [k for k in SHAPE_KEYS if k in df.columns]


def shape_labels(df: pd.DataFrame) -> list[str]:
    """A short readable label per row's shape (``case``), extended with the keys that tell
    apart shapes that would otherwise share a label (seed, num_threads, ...)."""
    keys = shape_keys(df)
    records = df.to_dict("records")
    base = [
        case({**r, "compile": "off"}) for r in records
    ]  # compile is part of the way, not the shape
    tuples = [tuple(str(r.get(k)) for k in keys) for r in records]
    by_label: dict[str, set] = {}
    for label, t in zip(base, tuples):
        by_label.setdefault(label, set()).add(t)
    out = []
    for label, t in zip(base, tuples):
        if len(by_label[label]) > 1:
            differing = [k for i, k in enumerate(keys) if len({u[i] for u in by_label[label]}) > 1]
            label += " " + " ".join(f"{k}={v}" for k, v in zip(keys, t) if k in differing)
        out.append(label)
    return out


def _interval(row: dict, prefix: str) -> tuple[float, float, float]:
    center = number(row.get(prefix if prefix == "speedup" else f"{prefix}_median"))
    low, high = number(row.get(f"{prefix}_ci_low")), number(row.get(f"{prefix}_ci_high"))
    if math.isnan(low) or math.isnan(high):  # no interval: cannot be ruled in or out
        return center, -math.inf, math.inf
    return center, low, high


def rank_shape(rows: list[dict]) -> dict:
    """Best, contenders and winner among one shape's correct timed rows (at least one)."""
    speedup = all(not math.isnan(number(r.get("speedup"))) for r in rows)
    prefix = "speedup" if speedup else "latency_ms"
    sign = 1 if speedup else -1  # higher speedup is better; lower latency is better
    scored = sorted(rows, key=lambda r: -sign * _interval(r, prefix)[0])
    best = scored[0]
    _, best_low, best_high = _interval(best, prefix)
    contenders = [
        r
        for r in scored
        if r is best
        or (
            _interval(r, prefix)[2] >= best_low if speedup else _interval(r, prefix)[1] <= best_high
        )
    ]
    names = [way(r) for r in contenders]
    busy = sum(flag(r.get("contended")) for r in rows)  # timed on a busy machine: decides nothing
    won, tied = winning_factors(contenders, rows) if len(contenders) > 1 and not busy else ("", "")
    return {
        "basis": prefix if speedup else "latency",
        "winner": names[0] if len(names) == 1 and not busy else "",
        "contenders": ";".join(names),
        "best": names[0],
        "n_ways": len(rows),
        "best_speedup": number(best.get("speedup")),
        "best_speedup_ci_low": number(best.get("speedup_ci_low")),
        "best_speedup_ci_high": number(best.get("speedup_ci_high")),
        "best_latency_ms": number(best.get("latency_ms_median")),
        "best_latency_ms_ci_low": number(best.get("latency_ms_ci_low")),
        "best_latency_ms_ci_high": number(best.get("latency_ms_ci_high")),
        "best_noise_target_met": best.get("noise_target_met"),
        "winner_factors": won,
        "tied_factors": tied,
        "busy": busy,
    }


def winning_factors(contenders: list[dict], rows: list[dict]) -> tuple[str, str]:
    """A tie that is a family: the factors every contender shares and that tell them from the
    other ways at the shape ("structure=fused attention=sdpa"), when the ways with those factors
    are exactly the contenders; and the factors they differ in ("merge"). ("", "") otherwise."""
    mine = [factors(r) for r in contenders]
    every = [factors(r) for r in rows]
    shared = {k: v for k, v in mine[0].items() if all(f.get(k) == v for f in mine)}
    telling = {k: v for k, v in shared.items() if len({f.get(k) for f in every}) > 1}
    family = [f for f in every if all(f.get(k) == v for k, v in telling.items())]
    if not telling or len(family) != len(mine) or len(family) == len(every):
        return "", ""
    differ = sorted({k for f in mine for k in f if any(g.get(k) != f.get(k) for g in mine)})
    return " ".join(f"{k}={v}" for k, v in telling.items()), " ".join(differ)


def rank(df: pd.DataFrame) -> pd.DataFrame:
    """One row per shape that has at least one correct timed way, in sweep order (``df``: any
    rows; ``rank_timed`` when they are the correct timed rows already)."""
    timed = timed_ok(df)
    if "shape" not in timed.columns:
        timed = timed.assign(shape=shape_labels(timed))
    return rank_timed(timed)


def rank_timed(timed: pd.DataFrame) -> pd.DataFrame:
    """``rank`` of the correct timed rows (``results.timed_ok``) labelled with their ``shape``."""
    if timed.empty:
        return pd.DataFrame(columns=COLUMNS)
    keys = shape_keys(timed)
    out = []
    for _, group in timed.groupby([timed[k].astype(str) for k in keys], sort=False, dropna=False):
        rows = group.to_dict("records")
        first = rows[0]
        out.append({**{k: first.get(k) for k in keys}, "shape": first["shape"], **rank_shape(rows)})
    return pd.DataFrame(out, columns=[c for c in COLUMNS if c in keys or c not in SHAPE_KEYS])
