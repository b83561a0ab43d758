"""Regimes on CUDA: which shapes run at Python's pace and which at the GPU's, in sentences. A way
is launch-bound where its eager call time is at least ``schema.LAUNCH_BOUND`` x its device time
(the call replayed from a CUDA graph: harness/measure/session.py); the ranking and the effects
use device time, and the eager comparison gets a sentence of its own where it differs."""

from __future__ import annotations

import math

import pandas as pd

from harness import schema
from harness.report.ways import way_name
from harness.report.ranking import rank_shape, shape_labels
from harness.results import number, timed_rows, way


def _x(value: float) -> str:
    return f"{value:.2f}x" if value < 10 else f"{value:.0f}x"


def _true(value) -> bool:
    return value is True or str(value).lower() == "true"


def _launch_bound(row: dict) -> bool | None:
    """The row's ``launch_bound``, or where the rows have no such column, the rule itself
    (harness/schema.py: eager call time at least LAUNCH_BOUND x device time, on rows whose device
    time was measured from a CUDA-graph replay); None where it does not apply."""
    if "launch_bound" in row:
        value = row["launch_bound"]
        if value is None or value != value or value == "":
            return None
        return _true(value)
    return schema.launch_bound({k: (None if v != v else v) for k, v in row.items()})


def _ms(values) -> str:
    """A few times in ms as one figure or a range: "0.2", "0.05-0.09"."""
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return "?"
    low, high = min(values), max(values)
    if high <= 1.05 * low:
        return f"{sorted(values)[len(values) // 2]:.2g}"
    return f"{low:.2g}-{high:.2g}"


def _short_shapes(shapes: list[str]) -> dict[str, str]:
    """Each shape label by its batch, length and the words that tell it from the others
    ("B=2 L=1024 mask=none" for "B=2 L=1024 E=1024 H=16 bfloat16 cuda mask=none")."""
    words = {s: s.split() for s in shapes}
    common = set.intersection(*(set(w) for w in words.values())) if words else set()
    return {
        s: " ".join(w for i, w in enumerate(ws) if i < 2 or w not in common)
        for s, ws in words.items()
    }


EAGER_AS = {  # the eager columns under the names ranking.rank_shape reads
    "speedup": "eager_speedup",
    "speedup_ci_low": "eager_speedup_ci_low",
    "speedup_ci_high": "eager_speedup_ci_high",
    "latency_ms_median": "eager_ms_median",
    "latency_ms_ci_low": "eager_ms_ci_low",
    "latency_ms_ci_high": "eager_ms_ci_high",
}


def eager_rank(rows: list[dict]) -> dict | None:
    """The shape's ranking by eager call time (``ranking.rank_shape`` on the eager columns): its
    best, contenders and winner; None where no row has an eager time."""
    rows = [r for r in rows if not math.isnan(number(r.get("eager_ms_median")))]
    if not rows:
        return None
    ranked = rank_shape([{**r, **{k: r.get(v) for k, v in EAGER_AS.items()}} for r in rows])
    best = next(r for r in rows if way(r) == ranked["best"])
    return {**ranked, "row": best}


def _eager_best(ranked: dict) -> str:
    """The eager ranking in words: the best with its eager speedup (or call time) and interval,
    and whether it wins or ties."""
    best = ranked["row"]
    speed = number(best.get("eager_speedup"))
    low, high = number(best.get("eager_speedup_ci_low")), number(best.get("eager_speedup_ci_high"))
    itself = best.get("variant") == "reference" and best.get("compile") in (None, "off")
    if not math.isnan(speed) and not itself:  # nn.MHA's own speedup is 1: its time says more
        figure = f"{_x(speed)}" + ("" if math.isnan(low) else f" [{low:.2f}, {high:.2f}]")
        figure += " nn.MultiheadAttention's eager speed"
    else:
        ms = number(best.get("eager_ms_median"))
        low, high = number(best.get("eager_ms_ci_low")), number(best.get("eager_ms_ci_high"))
        figure = f"{ms:.3g} ms" + ("" if math.isnan(low) else f" [{low:.3g}, {high:.3g}]")
        figure += " a call"
    best_name = way_name(ranked["best"])
    if ranked["winner"]:
        return f"{best_name} is fastest, {figure}, clear of every other way"
    tied = len([c for c in str(ranked["contenders"]).split(";") if c])
    return (
        f"{tied} of {ranked['n_ways']} ways cannot be told apart, within the best's interval "
        f"({best_name}: {figure})"
    )


def regimes(rows: pd.DataFrame | None, ranked: pd.DataFrame | None = None) -> list[dict]:
    """Which regime each shape is in, where the rows carry eager call times (CUDA): a "regime"
    finding over the shapes (launch-bound: eager call time at least LAUNCH_BOUND x device time;
    at a launch-bound shape Python's pace, not the GPU, sets how long an eager call takes), and
    an "eager" finding per shape where the eager comparison differs from the device-time one
    (every way launch-bound, or another fastest way)."""
    if rows is None or rows.empty or "eager_ms_median" not in rows.columns:
        return []
    ok = timed_rows(rows)  # eager call times: a way timed between events has one too
    ok = ok[pd.to_numeric(ok["eager_ms_median"], errors="coerce").notna()]
    if ok.empty:
        return []
    if "shape" not in ok.columns:
        ok = ok.assign(shape=shape_labels(ok))
    short = _short_shapes(list(dict.fromkeys(ok["shape"])))
    device_best = {}
    if ranked is not None and len(ranked):
        device_best = {r["shape"]: r for r in ranked.to_dict("records")}
    everyone, none_, some, eager_said = [], [], [], []
    uncaptured = 0
    for shape, group in ok.groupby("shape", sort=False):
        records = group.to_dict("records")
        bound = [_launch_bound(r) for r in records]
        judged = [b for b in bound if b is not None]
        n_bound = sum(judged)
        uncaptured += sum(str(r.get("timed_by")) == "events" for r in records)
        label = short[shape]
        if judged and n_bound == len(records):
            everyone.append(label)
        elif not n_bound and judged:
            none_.append(label)
        elif judged:
            some.append(f"{n_bound} of {len(records)} ways at {label}")
        eager = [number(r.get("eager_ms_median")) for r in records]
        device = [number(r.get("latency_ms_median")) for r in records]
        ranked_eager = eager_rank(records)
        dev = device_best.get(shape)
        if judged and n_bound == len(records):
            text = (
                f"every way at {label} runs at Python's pace: {_ms(eager)} ms an eager call "
                f"(device time {_ms(device)} ms ranks them)"
            )
            if ranked_eager:
                text += "; by eager call time, " + _eager_best(ranked_eager)
            eager_said.append({"factor": "eager", "text": text + ".", "anchor": "regime"})
        elif ranked_eager and dev is not None:
            dev_contenders = [c for c in str(dev["contenders"]).split(";") if c]
            eager_contenders = [c for c in str(ranked_eager["contenders"]).split(";") if c]
            if ranked_eager["best"] not in dev_contenders or dev["best"] not in eager_contenders:
                text = (
                    f"at {label} ({n_bound} of {len(records)} ways launch-bound; eager "
                    f"{_ms(eager)} ms a call, device {_ms(device)} ms), by eager call time "
                    + _eager_best(ranked_eager)
                    + f", where device time ranks {way_name(dev['best'])} first"
                )
                eager_said.append({"factor": "eager", "text": text + ".", "anchor": "regime"})
    parts = []
    if everyone:
        parts.append("every way is launch-bound at " + ", ".join(everyone))
    if some:
        parts.append("launch-bound: " + ", ".join(some))
    if none_:
        parts.append("the GPU sets the pace (no way launch-bound) at " + ", ".join(none_))
    if parts:
        parts[-1] += (
            f" (launch-bound: eager call time at least {schema.LAUNCH_BOUND:g}x device time, the "
            "call replayed from a CUDA graph; device time ranks the ways and makes the effects)"
        )
    if uncaptured:
        parts.append(
            f"{uncaptured} timed way{'s' if uncaptured != 1 else ''} could not be captured in a "
            "CUDA graph (`graph_error`): their latency is the eager call time"
        )
    if not parts:
        return eager_said
    text = "; ".join(parts)
    regime = {"factor": "regime", "text": text + ".", "anchor": "regime"}
    return [regime, *eager_said]
