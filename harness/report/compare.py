"""A/B: the same points measured in two runs (a changed variant, a torch upgrade, another machine).

    python -m harness.compare <dir A> <dir B> [--threshold 0.05] [--basis speedup|latency]
        [--out FILE.html]

Points are matched on what defines them (the way: variant, options, compile mode, SDPA pin; and
the shape: sizes, dtype, device, mask, mode, seed; not the machine, threads or torch version,
which are what an A/B usually changes).

Drift: two runs minutes apart on a shared machine differ by 10-25% in raw latency, so comparing
latencies flags noise. The default basis compares each way *relative to nn.MultiheadAttention
timed in the same rounds of its own run*. Every ratio reads one way, B over A in time:

    ratio = B's time / A's time   (above 1: B is slower)

on the speedup basis each time in units of its own run's nn.MHA time, i.e. speedup_A /
speedup_B; on the latency basis the raw latencies. Its 95% interval combines both runs'
intervals (independent runs: log half-widths add in quadrature). Drift that both the way and
nn.MHA saw cancels.

Verdicts: the interval contains 1 and lies within 1 +- threshold: ``same``; it contains 1 but
reaches past 1 +- threshold: ``cannot tell (+-N%)`` (too wide to see a change of the threshold's
size, N its half-width: a busy run's intervals); above 1: ``slower``, and a ``regression`` when
the ratio also exceeds 1 + threshold; below 1: ``faster``. Two sides timed differently
(``timed_by``: a CUDA graph's replay against the eager call's events, as a run from before
device time had) are ``not compared``: the change would be the method's; the CPU's two clocks
(``cpu``: the timed thread's CPU time, ``wall``) are compared, as on a quiet machine they agree.
A point either of whose rows stayed ``contended`` (timed on a busy machine,
harness/report/busy.py) is ``not comparable (A busy)``, ``(B busy)`` or ``(A and B busy)``:
never slower, faster or a regression. A point without an interval (old files, one round) is
judged on the threshold alone.

Exit status (``EXIT_*``):

    0  every point that could be compared was, and none is a regression
    1  a regression among the comparable points (EXIT_REGRESSION), whatever else
    2  refused: a path that does not exist, a bad --threshold
    3  not comparable (EXIT_NOT_COMPARABLE): some matched point was timed on a busy machine (the
       first line printed says which run and how busy), or its interval cannot tell a change of
       the threshold's size, or no matched point could be compared at all (none matched, or
       every one was not compared: a line says why); "compared 0 points" is never a pass

The reference itself: nn.MultiheadAttention's rows have a speedup of 1 by definition, so on the
speedup basis they are listed with their raw latency ratio and the verdict ``reference`` (never
a regression). When nn.MHA itself changes (a torch upgrade), every way's speedup at a shape moves
by the same factor; the summary prints nn.MHA's latency ratio and warns when the torch versions
differ. ``--basis latency`` compares raw latencies with their intervals instead (gate nn.MHA or a
torch upgrade that way, on a quiet machine).

Writes ``compare.csv`` beside the HTML report (one row per matched point) and prints a line each.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import jinja2
import pandas as pd

from harness.report import figures
from harness.measure import stats
from harness.report.busy import busy_detail, flag
from harness.report.render import TEMPLATES, num, prepare
from harness.config import keys_with
from harness.progress import headline
from harness.results import CONFIG_KEYS, distinct, number, DamagedFile, read_csv, read_results
from harness.files import WriteError, atomic_write_text, check_writable

EXIT_REGRESSION = 1
EXIT_REFUSED = 2
EXIT_NOT_COMPARABLE = 3

# What a ratio is, in the words of the chart's axis, the printed lines and the HTML (one direction:
# B over A in time, above 1 B is slower).
RATIO_WORDS = {
    "speedup": "B's time / A's time, each relative to nn.MHA in its own run (= speedup A / "
    "speedup B)",
    "latency": "B's latency / A's latency (raw times: drift between the runs included)",
}
# The verdicts of points judged (the rest are "not compared (...)" or "not comparable (...)").
JUDGED = ("regression", "slower", "same", "faster", "reference")

# What matches a point of A with one of B: its way and its shape, every key of those roles
# (config.ROLES), not the machine's (threads), which an A/B usually changes.
MATCH_KEYS = [k for k in CONFIG_KEYS if k not in keys_with("machine")]
CSV_COLUMNS = [
    "way",
    *MATCH_KEYS,
    "basis",
    "ratio",
    "ratio_ci_low",
    "ratio_ci_high",
    "verdict",
    "latency_ms_a",
    "latency_ms_b",
    "speedup_a",
    "speedup_b",
    "status_a",
    "status_b",
]


def load(path: Path) -> pd.DataFrame:
    """A side's rows: a results CSV, or a run/sweep dir's (``results.read_results``: checked
    against its jobs, gathered again where they disagree, which is said)."""
    if not path.is_dir():
        return results_table(read_csv(path), path)
    problems: list[str] = []
    df = read_results(path, problems)
    for line in problems:
        print(f"warning: {line}", file=sys.stderr)
    return df


def results_table(df: pd.DataFrame, path: Path) -> pd.DataFrame:
    """``df`` when it is a results table (mha-bench's columns); else ``DamagedFile`` naming
    ``path`` (a JSON file, another program's CSV: it compared nothing, and said only that)."""
    if not {"status", "variant"} <= set(df.columns):
        raise DamagedFile(
            f"{path} is not an mha-bench results table (no status and variant columns; "
            "give a run or sweep dir, or its results.csv)"
        )
    return df


def _triple(r: dict, side: str, basis: str) -> tuple[float, float, float]:
    """(centre, low, high) of one side's figure on the basis, as latency-like (higher = slower)."""
    if basis == "speedup":  # 1 / speedup: the way's time in units of nn.MHA's time
        c, lo, hi = (number(r.get(f"speedup{s}_{side}")) for s in ("", "_ci_low", "_ci_high"))
        return 1 / c if c else math.nan, 1 / hi if hi else math.nan, 1 / lo if lo else math.nan
    return tuple(number(r.get(f"latency_ms_{s}_{side}")) for s in ("median", "ci_low", "ci_high"))


def ab_change(ratio: stats.Interval, threshold: float) -> str:
    """B against A: regression (slower by more than ``threshold``), slower, same or faster."""
    if math.isnan(ratio.center):
        return "not compared"
    if math.isnan(ratio.low):  # no interval: the threshold alone decides
        if ratio.center > 1 + threshold:
            return "regression"
        return "faster" if ratio.center < 1 - threshold else "same"
    if ratio.low > 1:
        return "regression" if ratio.center > 1 + threshold else "slower"
    if ratio.high < 1:
        return "faster"
    if ratio.high > 1 + threshold or ratio.low < 1 - threshold:  # it could hide a change
        half = (ratio.high - ratio.low) / 2 / ratio.center
        return f"cannot tell ({chr(177)}{half:.0%})"
    return "same"


def matched(a: pd.DataFrame, b: pd.DataFrame, how: str = "inner") -> pd.DataFrame:
    """The rows of A and B matched on their way and shape (``MATCH_KEYS``), columns suffixed _a
    and _b, ``_merge`` saying which side has a row (``how="outer"`` keeps the unmatched)."""
    keys = [k for k in MATCH_KEYS if k in a.columns and k in b.columns]
    a, b = a.copy(), b.copy()
    for df in (a, b):  # NaN never equals NaN: match on a filled copy of the keys
        for k in keys:
            df[f"_k_{k}"] = df[k].astype(str)
    kk = [f"_k_{k}" for k in keys]
    return a.merge(b, on=kk, how=how, suffixes=("_a", "_b"), indicator=True)


def compare(
    a: pd.DataFrame, b: pd.DataFrame, threshold: float, basis: str = "speedup"
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Matched pairs with ratio (B's time over A's, above 1: B slower), interval and verdict; and
    the points only one side has."""
    # one row per configuration; both sides with the columns a verdict reads, so that they merge
    # into _a and _b (a run from before a column: None, not contended)
    a, b = (
        df.assign(**{c: None for c in ("timed_by", "contended") if c not in df.columns})
        for df in (a, b)
    )
    merged = matched(prepare(distinct(a)), prepare(distinct(b)), how="outer")
    only = merged[merged["_merge"] != "both"]
    pairs = merged[merged["_merge"] == "both"].copy()
    out = []
    for r in pairs.to_dict("records"):
        reference = str(r.get("variant_a")) == "reference" and str(r.get("compile_a")) in (
            "off",
            "nan",
        )
        has_speedup = not math.isnan(number(r.get("speedup_a"))) and not math.isnan(
            number(r.get("speedup_b"))
        )
        used = "speedup" if basis == "speedup" and has_speedup and not reference else "latency"
        timed = (_timed_by(r, "a"), _timed_by(r, "b"))
        busy = [side.upper() for side in ("a", "b") if flag(r.get(f"contended_{side}"))]
        if r["status_a"] != "ok" or r["status_b"] != "ok":
            ratio, v = stats.NAN, f"not compared ({r['status_a']} / {r['status_b']})"
        elif busy:  # timed on a busy machine: its figures decide nothing
            ratio, v = stats.NAN, f"not comparable ({' and '.join(busy)} busy)"
        # device time against eager events: not the same figure (the CPU's two clocks are: on a
        # quiet machine they agree, and a busy one's waits are what the CPU clock leaves out)
        elif timed[0] != timed[1] and not set(timed) <= {"cpu", "wall"}:
            ratio, v = stats.NAN, f"not compared (timed by {timed[0]} / {timed[1]})"
        else:
            ratio = stats.ratio_of_intervals(_triple(r, "a", used), _triple(r, "b", used))
            v = "reference" if reference and basis == "speedup" else ab_change(ratio, threshold)
        out.append(
            {
                "ratio": ratio.center,
                "ratio_ci_low": ratio.low,
                "ratio_ci_high": ratio.high,
                "verdict": v,
                "basis": used,
            }
        )
    for col in ("ratio", "ratio_ci_low", "ratio_ci_high", "verdict", "basis"):
        pairs[col] = [o[col] for o in out]
    pairs["way"], pairs["shape"] = pairs["way_a"], pairs["shape_a"]
    for k in (k for k in MATCH_KEYS if f"{k}_a" in pairs.columns and f"{k}_b" in pairs.columns):
        pairs[k] = pairs[f"{k}_a"]
    for col in ("latency_ms_median", "speedup"):
        for side in ("a", "b"):
            src = f"{col}_{side}"
            pairs[f"{col.replace('_median', '')}_{side}"] = pairs[src] if src in pairs else math.nan
    only = only.assign(
        side=only["_merge"].map({"left_only": "A only", "right_only": "B only"}),
        way=only["way_a"].fillna(only["way_b"]),
        shape=only["shape_a"].fillna(only["shape_b"]),
    )
    return pairs, only


def _timed_by(r: dict, side: str) -> str:
    """What a side's latency is (the row's ``timed_by``); a row from before the column: CUDA
    events around the eager call on a GPU, the wall clock on a CPU."""
    said = r.get(f"timed_by_{side}")
    if isinstance(said, str) and said:
        return said
    return "events" if str(r.get(f"device_{side}", "")).startswith("cuda") else "wall"


def ratio_figure(pairs: pd.DataFrame, threshold: float) -> str | None:
    data = pairs[pairs["ratio"].notna()]
    if data.empty:
        return None
    import matplotlib.pyplot as plt

    labels = [f"{w} | {s}" for w, s in zip(data["way"], data["shape"])]
    colors = {
        "regression": "#c62828",
        "slower": "#ef9a9a",
        "same": "#9e9e9e",
        "faster": "#1565c0",
        "reference": "#6d4c41",
    }
    low = (data["ratio"] - data["ratio_ci_low"]).fillna(0)
    high = (data["ratio_ci_high"] - data["ratio"]).fillna(0)
    fig, ax = plt.subplots(figsize=(9, 0.28 * len(data) + 1.2))
    ax.barh(
        range(len(data)),
        data["ratio"] - 1,
        left=1,
        xerr=[low, high],
        color=[colors.get(v, "#9e9e9e") for v in data["verdict"]],
    )
    ax.axvline(1, color="black", linewidth=0.8)
    ax.axvline(1 + threshold, color="#c62828", linestyle="--", linewidth=0.8)
    ax.set_yticks(range(len(data)), labels, fontsize=7)
    ax.invert_yaxis()
    bases = set(data["basis"])
    words = RATIO_WORDS["latency" if bases == {"latency"} else "speedup"]
    if len(bases) > 1:
        words += "; nn.MHA's own rows: raw latency"
    ax.set_xlabel(f"{words}; above 1: B slower; error bar: 95% interval", fontsize=8)
    return figures.png(fig)


def _torch_versions(df: pd.DataFrame) -> set[str]:
    return set(df["torch_version"].dropna().astype(str)) if "torch_version" in df.columns else set()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mha-bench compare", description=headline(__doc__))
    parser.add_argument("a", help="run or sweep dir (or results.csv) A, the baseline")
    parser.add_argument("b", help="run or sweep dir (or results.csv) B, the candidate")
    parser.add_argument(
        "--threshold",
        type=float,
        default=0.05,
        help="a slower point is a regression beyond this fraction (default 0.05 = 5%%)",
    )
    parser.add_argument(
        "--basis",
        choices=("speedup", "latency"),
        default="speedup",
        help="speedup: each way relative to nn.MHA in its own run (drift cancels; default); "
        "latency: raw latencies",
    )
    parser.add_argument(
        "--out",
        default=None,
        help="HTML report path (default: reports/compare-<A>-vs-<B>.html); "
        "compare.csv is written beside it",
    )
    args = parser.parse_args(argv)
    if not 0 <= args.threshold < 10:
        print(
            f"error: --threshold={args.threshold} must be a fraction such as 0.05", file=sys.stderr
        )
        return EXIT_REFUSED
    paths = [Path(args.a), Path(args.b)]
    for p in paths:
        if not p.exists():
            print(f"error: {str(p)!r} does not exist", file=sys.stderr)
            return EXIT_REFUSED
    out = (
        Path(args.out)
        if args.out
        else Path("reports")
        / f"compare-{paths[0].resolve().name}-vs-{paths[1].resolve().name}.html"
    )
    try:  # before the work: a report that cannot be written is said first, in one line
        check_writable(out.parent)
    except WriteError as e:
        print(f"error: --out {str(out)!r}: {e.strerror}", file=sys.stderr)
        return EXIT_REFUSED
    a, b = (load(p) for p in paths)
    pairs, only = compare(a, b, args.threshold, args.basis)
    judged = pairs[pairs["verdict"].isin(JUDGED)]
    busy = busy_said(pairs, a, b)
    if busy:
        print(busy)
    if judged.empty:
        print(nothing_compared(pairs, only))
    print(f"ratio = {RATIO_WORDS[args.basis]}; above 1: B is slower")
    for r in pairs.to_dict("records"):
        interval = (
            f" [{r['ratio_ci_low']:.3f}, {r['ratio_ci_high']:.3f}]"
            if r["ratio_ci_low"] == r["ratio_ci_low"]
            else ""
        )
        print(
            f"{r['verdict']:<11} {r['ratio']:7.3f}x{interval} ({r['basis']})  "
            f"{r['way']}  [{r['shape']}]"
            if r["ratio"] == r["ratio"]
            else f"{r['verdict']}  {r['way']}  [{r['shape']}]"
        )
    counts = pairs["verdict"].value_counts().to_dict()
    regressions = int(counts.get("regression", 0))
    untold = int(pairs["verdict"].astype(str).str.startswith("cannot tell").sum())
    notes = []
    refs = pairs[pairs["verdict"] == "reference"]
    if len(refs):
        notes.append(
            f"nn.MultiheadAttention's own latency B/A: median {refs['ratio'].median():.3f} over "
            f"{len(refs)} shapes (raw latency: includes the machine's drift between the runs)"
        )
    ta, tb = _torch_versions(a), _torch_versions(b)
    if ta and tb and ta != tb:
        notes.append(
            f"torch differs (A: {', '.join(sorted(ta))}; B: {', '.join(sorted(tb))}): "
            "speedups are relative to each run's own nn.MultiheadAttention, so a change in nn.MHA "
            "itself moves every way at a shape by the same factor; use --basis latency on a quiet "
            "machine to gate nn.MHA or raw times"
        )
    csv_path = out.with_suffix(".csv") if out.suffix == ".html" else out.parent / "compare.csv"
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), autoescape=True)
    env.filters["num"] = num
    html = env.get_template("compare.html.j2").render(
        a=str(paths[0]),
        b=str(paths[1]),
        threshold=args.threshold,
        counts=tally(pairs),
        basis=args.basis,
        ratio_words=RATIO_WORDS[args.basis],
        busy=busy,
        nothing=nothing_compared(pairs, only) if judged.empty else "",
        notes=notes,
        pairs=pairs.sort_values("ratio", ascending=False).to_dict("records"),
        only=only[["side", "way", "shape"]].to_dict("records"),
        ratio_png=ratio_figure(pairs, args.threshold),
        csv_name=csv_path.name,
    )
    try:  # each replaced whole (a symlink there is replaced, its target left alone)
        atomic_write_text(csv_path, pairs.reindex(columns=CSV_COLUMNS).to_csv(index=False))
        atomic_write_text(out, html)
    except WriteError as e:  # a full disk, meanwhile
        print(f"error: {e.strerror}", file=sys.stderr)
        return EXIT_REFUSED
    for note in notes:
        print(f"note: {note}")
    summary = ", ".join(f"{n} {v}" for v, n in tally(pairs).items()) or "no matched points"
    print(
        f"compared {len(judged)} of {len(pairs)} matched points ({summary}); {len(only)} "
        f"unmatched; threshold {args.threshold:.0%}"
    )
    print(f"compare: {csv_path}")
    print(f"report: {out}")
    if regressions:
        return EXIT_REGRESSION
    return EXIT_NOT_COMPARABLE if busy or untold or judged.empty else 0


def tally(pairs: pd.DataFrame) -> dict:
    """How many points got each verdict, "cannot tell" counted as one (their widths differ)."""
    verdicts = pairs["verdict"].astype(str)
    verdicts = verdicts.str.replace(r"^cannot tell.*", "cannot tell", regex=True)
    return verdicts.value_counts().to_dict()


def busy_said(pairs: pd.DataFrame, a: pd.DataFrame, b: pd.DataFrame) -> str:
    """The line compare prints first when a matched point is not comparable because its run's
    machine was busy: which run, how busy, what to do; empty otherwise."""
    verdicts = pairs["verdict"].astype(str)
    sides = [
        (side, rows)
        for side, rows in (("A", a), ("B", b))
        if verdicts.str.match(rf"not comparable \((.* )?{side}( .*)? busy\)").any()
    ]
    if not sides:
        return ""
    runs = "run " + sides[0][0] if len(sides) == 1 else "runs A and B"
    details = [
        busy_detail(rows, "its rounds") or "its rounds stayed contended" for _, rows in sides
    ]
    said = (
        details[0]
        if len(sides) == 1
        else "; ".join(f"{side}: {d}" for (side, _), d in zip(sides, details))
    )
    n = int(verdicts.str.startswith("not comparable").sum())
    return (
        f"not comparable: the machine was busy during {runs}: {said}; {n} matched point"
        f"{'s' if n != 1 else ''} not compared; re-run on a quiet machine"
    )


def nothing_compared(pairs: pd.DataFrame, only: pd.DataFrame) -> str:
    """Why no matched point was compared: none matched, or each one was not comparable."""
    if pairs.empty:
        sides = only["side"].value_counts().to_dict() if len(only) else {}
        return (
            f"nothing compared: A and B share no point ({sides.get('A only', 0)} only in A, "
            f"{sides.get('B only', 0)} only in B; points match on their way and shape)"
        )
    why = ", ".join(f"{n} {v}" for v, n in tally(pairs).items())
    return f"nothing compared: none of the {len(pairs)} matched points could be ({why})"


if __name__ == "__main__":
    from harness.leaving import leave

    leave(main)
