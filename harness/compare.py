"""A/B: the same points measured twice (a torch upgrade, a changed variant, another machine).

    python -m harness.compare <dir A> <dir B> [--threshold 0.05] [--out reports/compare.html]

Points are matched on what defines them (variant and its options, compile mode, SDPA pin and
the shape; not the machine, threads or torch version, which are what an A/B usually changes).
For every matched pair with both sides ok: ratio = B / A median latency, and a verdict that
respects each side's recorded spread. Each side's uncertainty is half its interquartile range
relative to its median; the pair's is the root sum of squares of both. A change smaller than
that is ``same``; beyond it, ``faster`` or ``slower``. A ``slower`` pair whose ratio also exceeds
1 + threshold is a regression, and any regression makes the exit status 1 (gate CI on it).
Writes an A/B HTML report and prints one line per pair.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import jinja2
import pandas as pd

from harness import figures
from harness.report import TEMPLATES, _num, prepare
from harness.results import RESULTS_FILE, gather

MATCH_KEYS = ["variant", "variant_options", "compile", "sdpa_backend", "batch", "seq_len", "kv_seq_len",
              "embed_dim", "num_heads", "dtype", "device", "mask", "mask_format", "mode", "cross", "bias",
              "need_weights", "average_attn_weights", "seed"]


def load(path: Path) -> pd.DataFrame:
    csv = path / RESULTS_FILE if path.is_dir() else path
    if csv.exists():
        return pd.read_csv(csv, keep_default_na=False, na_values=[""])
    return gather(path)


def spread(median: float, iqr: float) -> float:
    """Relative uncertainty of one side's median: half its IQR over the median."""
    if not median or median != median or iqr != iqr:
        return math.inf
    return 0.5 * iqr / median


def compare(a: pd.DataFrame, b: pd.DataFrame, threshold: float) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Matched pairs with ratio, band and verdict; and the points only one side has."""
    keys = [k for k in MATCH_KEYS if k in a.columns and k in b.columns]
    a, b = prepare(a), prepare(b)
    for df in (a, b):  # NaN never equals NaN: match on a filled copy of the keys
        for k in keys:
            df[f"_k_{k}"] = df[k].astype(str)
    kk = [f"_k_{k}" for k in keys]
    merged = a.merge(b, on=kk, how="outer", suffixes=("_a", "_b"), indicator=True)
    only = merged[merged["_merge"] != "both"]
    pairs = merged[merged["_merge"] == "both"].copy()
    verdicts, ratios, bands = [], [], []
    for r in pairs.to_dict("records"):
        if r["status_a"] != "ok" or r["status_b"] != "ok" or not r["latency_ms_median_a"] or not r["latency_ms_median_b"]:
            verdicts.append(f"not compared ({r['status_a']} / {r['status_b']})")
            ratios.append(float("nan"))
            bands.append(float("nan"))
            continue
        ratio = r["latency_ms_median_b"] / r["latency_ms_median_a"]
        band = math.hypot(spread(r["latency_ms_median_a"], r["latency_ms_iqr_a"]),
                          spread(r["latency_ms_median_b"], r["latency_ms_iqr_b"]))
        if ratio - 1 > band:
            verdict = "regression" if ratio > 1 + threshold else "slower"
        elif 1 - ratio > band:
            verdict = "faster"
        else:
            verdict = "same"
        verdicts.append(verdict)
        ratios.append(ratio)
        bands.append(band)
    pairs["ratio"], pairs["band"], pairs["verdict"] = ratios, bands, verdicts
    pairs["way"], pairs["shape"] = pairs["way_a"], pairs["shape_a"]
    only = only.assign(side=only["_merge"].map({"left_only": "A only", "right_only": "B only"}),
                       way=only["way_a"].fillna(only["way_b"]), shape=only["shape_a"].fillna(only["shape_b"]))
    return pairs, only


def ratio_figure(pairs: pd.DataFrame, threshold: float) -> str | None:
    data = pairs[pairs["ratio"].notna()]
    if data.empty:
        return None
    import matplotlib.pyplot as plt

    labels = [f"{w} | {s}" for w, s in zip(data["way"], data["shape"])]
    colors = {"regression": "#c62828", "slower": "#ef9a9a", "same": "#9e9e9e", "faster": "#1565c0"}
    fig, ax = plt.subplots(figsize=(9, 0.28 * len(data) + 1.2))
    ax.barh(range(len(data)), data["ratio"] - 1, left=1, xerr=data["band"],
            color=[colors.get(v, "#9e9e9e") for v in data["verdict"]])
    ax.axvline(1, color="black", linewidth=0.8)
    ax.axvline(1 + threshold, color="#c62828", linestyle="--", linewidth=0.8)
    ax.set_yticks(range(len(data)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("latency ratio B / A (error bar: the pair's noise band)")
    return figures.png(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.compare", description=__doc__.splitlines()[0])
    parser.add_argument("a", help="run or sweep dir (or results.csv) A, the baseline")
    parser.add_argument("b", help="run or sweep dir (or results.csv) B, the candidate")
    parser.add_argument("--threshold", type=float, default=0.05,
                        help="a slower point fails beyond this fraction (default 0.05 = 5%%)")
    parser.add_argument("--out", default=None, help="HTML report path (default: reports/compare-<A>-vs-<B>.html)")
    args = parser.parse_args(argv)
    if not 0 <= args.threshold < 10:
        print(f"error: --threshold={args.threshold} must be a fraction such as 0.05", file=sys.stderr)
        return 2
    paths = [Path(args.a), Path(args.b)]
    for p in paths:
        if not p.exists():
            print(f"error: {str(p)!r} does not exist", file=sys.stderr)
            return 2
    a, b = (load(p) for p in paths)
    pairs, only = compare(a, b, args.threshold)
    for r in pairs.to_dict("records"):
        print(f"{r['verdict']:<11} {r['ratio']:7.3f}x ±{r['band']:.3f}  {r['way']}  [{r['shape']}]"
              if r["ratio"] == r["ratio"] else f"{r['verdict']}  {r['way']}  [{r['shape']}]")
    counts = pairs["verdict"].value_counts().to_dict()
    regressions = int(counts.get("regression", 0))
    out = Path(args.out) if args.out else Path("reports") / f"compare-{paths[0].resolve().name}-vs-{paths[1].resolve().name}.html"
    out.parent.mkdir(parents=True, exist_ok=True)
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), autoescape=True)
    env.filters["num"] = _num
    out.write_text(env.get_template("compare.html.j2").render(
        a=str(paths[0]), b=str(paths[1]), threshold=args.threshold, counts=counts,
        pairs=pairs.sort_values("ratio", ascending=False).to_dict("records"),
        only=only[["side", "way", "shape"]].to_dict("records"),
        ratio_png=ratio_figure(pairs, args.threshold),
    ))
    summary = ", ".join(f"{n} {v}" for v, n in counts.items()) or "no matched points"
    print(f"compared {len(pairs)} points ({summary}); {len(only)} unmatched; threshold {args.threshold:.0%}")
    print(f"report: {out}")
    return 1 if regressions else 0


if __name__ == "__main__":
    sys.exit(main())
