"""The rows of the report's tables, from the analyzed rows: the fastest way per shape in a few
words (``short_label``, ``best_per_shape``, its ``legend``), the correctness table, the points
that did not run, and the pairing ``mha-bench paired`` asked for. Torch-free: pandas only.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from harness.progress import first_line
from harness.report import effects
from harness.report.analysis import PAIRED_FILE, Analysis
from harness.report.ways import way_name
from harness.results import way


def short_label(row: dict) -> str:
    """A way in a few words, for the compact table: its factors' values in order (structure,
    the variant's options, then +compile and an SDPA pin when set); the legend spells it out."""
    c = {k: v for k, v in effects.factors(row).items() if k not in effects.MODEL_KEYS}
    parts = [c.pop("structure")]  # the model's keys (K/V heads, mask) are the shape's, not its
    mode, pin = c.pop("compile"), c.pop("sdpa_backend")
    parts += list(c.values())
    if mode != "off":
        parts.append("+compile" if mode == "default" else f"+compile:{mode}")
    if pin != "auto":
        parts.append(f"sdpa:{pin}")
    return way_name(" ".join(parts))  # nn.MultiheadAttention, as the findings name it


def short_labels(df: pd.DataFrame) -> dict[str, str]:
    """way -> short label for every way in ``df`` (the full way where two would read the same)."""
    out: dict[str, str] = {}
    for r in df.to_dict("records"):
        out.setdefault(way(r), short_label(r))
    clashes = {v for v in out.values() if list(out.values()).count(v) > 1}
    return {w: (w if s in clashes else s) for w, s in out.items()}


def best_per_shape(a: Analysis) -> list[dict]:
    """The ranking per shape (a winner, or a tie between contenders), with the best row's
    throughput and the ways' short labels."""
    ok = a.timed
    short = short_labels(ok)
    rows = []
    for r in a.ranked.to_dict("records"):
        best = ok[(ok["shape"] == r["shape"]) & (ok["way"] == r["best"])].head(1).to_dict("records")
        best = best[0] if best else {}
        contenders = [c for c in str(r["contenders"]).split(";") if c]
        rows.append(
            {
                **r,
                "tflops": best.get("tflops"),
                "pct_of_peak": best.get("pct_of_peak"),
                "pct_of_datasheet_peak": best.get("pct_of_datasheet_peak"),
                # CUDA: what an eager caller of the best way waits per call
                "eager_ms": best.get("eager_ms_median"),
                "eager_ms_ci_low": best.get("eager_ms_ci_low"),
                "eager_ms_ci_high": best.get("eager_ms_ci_high"),
                "tied": contenders if not r["winner"] else [],
                "best_short": short.get(r["best"], r["best"]),
                "tied_short": [short.get(c, c) for c in contenders[1:]] if not r["winner"] else [],
            }
        )
    return rows


def legend(best: list[dict], timed: pd.DataFrame) -> list[tuple[str, str]]:
    """(short label, way) for the ways the compact table names, in the order it names them."""
    short = short_labels(timed)
    named = [w for b in best for w in [b["best"], *b["tied"]]]
    seen: dict[str, str] = {}
    for w in named:
        seen.setdefault(short.get(w, w), w)
    return [(s, way_name(w)) for s, w in seen.items() if s != way_name(w)]


def correctness_rows(df: pd.DataFrame) -> list[dict]:
    if "check_passed" not in df.columns:
        return []
    checked = df[df["check_passed"].notna()].copy()
    checked["_fail"] = ~checked["check_passed"].astype(bool)
    checked = checked.sort_values(
        ["_fail", "err_ratio" if "err_ratio" in checked else "_fail"],
        ascending=False,
        kind="stable",
    )
    cols = [
        "way",
        "shape",
        "check_passed",
        "worst_tensor",
        "failed_tensors",
        "max_abs_err",
        "tolerance",
        "err_ratio",
        "ref_err",
        "worst_index",
        "error",
        "diagnosis",
        "diagnosis_says",
        "wrong_where",
    ]
    return [
        {c: (None if r.get(c) != r.get(c) else r.get(c)) for c in cols}  # NaN: empty
        | {"way": way_name(r["way"])}
        for r in checked.to_dict("records")
    ]


def problem_rows(df: pd.DataFrame) -> list[dict]:
    """The points that did not run, each with its reason's first line (``short``; the whole
    text in ``error``, shown on demand: a compiler's error runs to hundreds of characters)."""
    bad = df[~df["status"].isin(["ok", "mismatch"])]
    return [
        {
            "way": way_name(r["way"]),
            "shape": r["shape"],
            "status": r["status"],
            "error": r.get("error"),
            "short": first_line(r.get("error")),
        }
        for r in bad.to_dict("records")
    ]


def paired_rows(root: Path) -> list[dict]:
    """The two ways ``mha-bench paired`` paired, when it was asked (paired.csv)."""
    path = root / PAIRED_FILE
    if not path.exists():
        return []
    try:
        return pd.read_csv(path).to_dict("records")
    except (OSError, ValueError, pd.errors.ParserError):
        return []
