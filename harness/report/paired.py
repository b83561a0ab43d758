"""Any two named ways of one sweep, paired round by round: "is transformers' sdpa attention as
fast as my fused SDPA module?" answered with one ratio and its interval.

    mha-bench paired DIR --ways LABEL_A LABEL_B

The effects (effects.py) pair only ways that differ in one factor; this pairs the two ways named,
whatever else differs, at every shape where both were timed. A label names a way as the report
prints it (``fused/attention=sdpa,merge=view +compile=default``), or by its ``label`` column or
variant name where that picks one way per shape. At each shape the ratio is A's time over B's
(above 1: B is faster), paired round by round from the rounds' journal (the drift both saw
cancels), with the same interval and re-run floor as an effect; over the shapes, their geometric
mean with the shapes' intervals combined (effects.summarize_pairs, pooled: the mean over these
shapes, which agrees with them when they agree), and how many shapes say each way. Writes
DIR/paired.csv, which the report shows as a section; a row of it is built as a row of
effects.csv is (effects.effect_row). Exit 0; 3 where the busy machine left every shape undecided
(as ``mha-bench compare``'s "not comparable"); 2 refused.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

from harness.report.analysis import PAIRED_FILE, prepare, read_rows
from harness.report.compare import EXIT_NOT_COMPARABLE
from harness.report.effects import effect_row, round_times, summarize_pairs
from harness.report.render import render_dir
from harness.results import EXIT_WRITE, timed_ok, way
from harness.files import WriteError, atomic_write_text
from harness.progress import headline

# paired.csv names the two ways A and B, not baseline and alternative
COLUMNS = {
    "baseline_way": "way_a",
    "alternative_way": "way_b",
    "baseline_ms": "ms_a",
    "alternative_ms": "ms_b",
    "baseline_mem_mb": "mem_mb_a",
    "alternative_mem_mb": "mem_mb_b",
}


class Unmatched(ValueError):
    """A label that names no way, or more than one at a shape: the message says which."""


# The uncompiled way of a label, said outright (its way carries no compile suffix)
UNCOMPILED = " +compile=off"


def chooser(rows: list[dict], label: str):
    """Which rows ``label`` names: a way exactly as the report prints it (``UNCOMPILED`` after it
    names the eager one, where a compiled copy has the same label), else a ``label`` column or a
    variant name, which may name several ways at a shape (then ``paired`` asks for one)."""
    exact = label.removesuffix(UNCOMPILED)
    if any(way(r) == exact for r in rows):
        return lambda row: way(row) == exact
    return lambda row: label in (str(row.get("label")), str(row.get("variant")))


def paired(df: pd.DataFrame, root: Path | None, a: str, b: str) -> pd.DataFrame:
    """One row per shape where both ways were timed (A's time / B's, its interval, the rounds
    paired), then the overall row (``shape`` = "all shapes")."""
    ok = timed_ok(df if "shape" in df.columns else prepare(df))
    if ok.empty:
        raise Unmatched("no timed ok rows to pair")
    records = ok.to_dict("records")
    picks = {label: chooser(records, label) for label in (a, b)}
    for label in (a, b):
        if not any(picks[label](r) for r in records):
            known = sorted({way(r) for r in records})
            raise Unmatched(f"{label!r} names no timed way of this sweep; its ways: {known}")
    times = round_times(root, ok)
    out = []
    for shape, group in ok.groupby("shape", sort=False):
        rows = group.to_dict("records")
        found = [[r for r in rows if picks[label](r)] for label in (a, b)]
        for label, matched in zip((a, b), found):
            if len(matched) > 1:
                raise Unmatched(
                    f"{label!r} names {len(matched)} ways at {shape}: "
                    f"{sorted(way(r) for r in matched)}; name one as the report prints it "
                    f"(the eager one of a compiled pair: its name and {UNCOMPILED!r})"
                )
        if not all(found) or found[0][0] is found[1][0]:
            continue
        row = effect_row(found[0][0], found[1][0], times)
        out.append({COLUMNS.get(k, k): v for k, v in row.items()})
    if not out:
        raise Unmatched(f"no shape has both {a!r} and {b!r} timed")
    table = pd.DataFrame(out)
    overall = summarize_pairs(table, pooled=True)
    everything = {
        "shape": "all shapes",
        "way_a": a,
        "way_b": b,
        "ratio": overall["ratio"],
        "ratio_ci_low": overall["ratio_ci_low"],
        "ratio_ci_high": overall["ratio_ci_high"],
        "verdict": overall["verdict"],
        "n_pairs": overall["n"],
        "basis": "geometric mean over the shapes, their intervals combined",
    }
    return pd.concat([table, pd.DataFrame([everything])], ignore_index=True)


def sentence(row: dict) -> str:
    """'B is 1.20x [1.15, 1.26] as fast as A (faster)' for one row of ``paired``."""
    if row["verdict"] == "busy" and row["ratio"] != row["ratio"]:
        every = " at every shape" if row.get("shape") == "all shapes" else ""
        return f"not measured: the machine was busy{every}"
    how = {
        "faster": "B is faster",
        "slower": "B is slower",
        "tie": "no difference",
        "busy": "the machine was busy, so this decides nothing",
    }[row["verdict"]]
    return (
        f"{row['ratio']:.3g}x [{row['ratio_ci_low']:.3g}, {row['ratio_ci_high']:.3g}] "
        f"(A's time / B's): {how}"
    )


def split(table: pd.DataFrame, row: dict) -> str:
    """For the overall row, where its shapes do not all say the same: how many say each way; and
    how many were left out, timed on a busy machine."""
    if row["shape"] != "all shapes":
        return ""
    counts = table[table["shape"] != "all shapes"]["verdict"].value_counts()
    busy = int(counts.pop("busy")) if "busy" in counts else 0
    left_out = f"; {busy} left out: the machine was busy" if busy and len(counts) else ""
    if len(counts) < 2:
        return left_out
    said = {"faster": "B faster", "slower": "B slower", "tie": "no difference"}
    return (
        "; the shapes differ: " + ", ".join(f"{n} {said[v]}" for v, n in counts.items()) + left_out
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mha-bench paired", description=headline(__doc__))
    parser.add_argument("dir", help="a sweep dir (results.csv and the rounds' journal)")
    parser.add_argument(
        "--ways",
        nargs=2,
        metavar=("LABEL_A", "LABEL_B"),
        required=True,
        help="the two ways to pair: as the report names them, or a label or variant name",
    )
    parser.add_argument("--no-report", action="store_true", help="do not re-render the report")
    args = parser.parse_args(argv)
    root = Path(args.dir)
    if not root.is_dir():
        print(f"error: {args.dir!r} is not a directory", file=sys.stderr)
        return 2
    a, b = args.ways
    try:
        table = paired(read_rows(root), root, a, b)
    except Unmatched as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"A = {a}\nB = {b}")
    for row in table.to_dict("records"):
        n = f"{row['n_pairs']} {'shapes' if row['shape'] == 'all shapes' else 'rounds'}"
        print(f"  {row['shape']}: {sentence(row)} ({n}{split(table, row)})")
    try:
        atomic_write_text(root / PAIRED_FILE, table.to_csv(index=False))
        print(f"paired: {root / PAIRED_FILE}")
        if not args.no_report:
            print(f"report: {render_dir(root)}")
    except WriteError as e:  # a read-only sweep dir: the lines above are the answer, said so
        print(
            f"error: {e.strerror}; the pairing is printed above (make {root} writable to keep "
            "it, or pass --no-report)",
            file=sys.stderr,
        )
        return EXIT_WRITE
    # as compare: a pairing the busy machine left undecided is no answer (exit 3), never a pass
    overall = table[table["shape"] == "all shapes"]["verdict"]
    return EXIT_NOT_COMPARABLE if (overall == "busy").any() else 0


if __name__ == "__main__":
    from harness.leaving import leave

    leave(main)
