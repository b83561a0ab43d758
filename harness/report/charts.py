"""The report's figures that are not lines along a swept key: the speedup heatmap (ways x
shapes) and the effects' forest plot, each a function of its table returning an inlined PNG
(base64), or None when the table is empty.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # no display; must precede pyplot
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker as mticker  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402

from harness.report.figures import MIN_W, png  # noqa: E402


def speedup_heatmap(
    speedups: pd.DataFrame, low: pd.DataFrame | None = None, high: pd.DataFrame | None = None
) -> str | None:
    """Ways of writing (rows) x shapes (columns): nn.MHA's latency / the way's, paired in the
    same rounds; >1 is faster. Each cell is one row, annotated with its 95% interval."""
    if speedups.empty or speedups.shape[1] == 0:
        return None
    annot = speedups.astype(float).map(lambda v: "" if v != v else f"{v:.2f}")
    if low is not None and high is not None:
        for r in annot.index:
            for c in annot.columns:
                lo, hi = low.loc[r, c], high.loc[r, c]
                if annot.loc[r, c] and lo == lo and hi == hi:
                    annot.loc[r, c] += f"\n{lo:.2f}-{hi:.2f}"
    width = min(30, max(MIN_W - 2, 2 + 0.85 * speedups.shape[1]))  # with its labels, >= 700 px
    height = min(20, 1.5 + 0.6 * speedups.shape[0])
    fig, ax = plt.subplots(figsize=(width, height))
    sns.heatmap(
        np.log2(speedups.astype(float)),
        annot=annot,
        fmt="",
        cmap="RdBu",
        center=0,
        cbar_kws={"label": "log2 speedup over nn.MultiheadAttention"},
        ax=ax,
        annot_kws={"fontsize": 7},
    )
    ax.set_xlabel("shape")
    ax.set_ylabel("")
    ax.tick_params(axis="x", labelrotation=90, labelsize=7)
    ax.set_title("Which ways beat nn.MultiheadAttention, at which shapes?", loc="left")
    return png(fig)


VERDICT_COLORS = {"faster": "#1565c0", "slower": "#c62828", "tie": "#757575"}
FOREST_SPLITS = ("dtype", "mask")
FOREST_TICKS = [
    0.01,
    0.02,
    0.05,
    0.1,
    0.2,
    0.3,
    0.5,
    0.7,
    0.8,
    0.9,
    1,
    1.1,
    1.25,
    1.5,
    2,
    3,
    5,
    10,
    20,
    50,
    100,
]  # the effects' sub-lines, where they vary


def forest(summary: pd.DataFrame) -> str | None:
    """The effects as a forest plot: a line per comparison (its geometric-mean ratio over the
    pairs and 95% interval), with a line per dtype and mask under it where they vary; log axis,
    1 = no effect, right of 1 the alternative is faster."""
    rows = summary[summary["by"].isin(("all", *FOREST_SPLITS))]
    rows = rows[pd.to_numeric(rows["ratio"], errors="coerce") > 0]
    if rows.empty:
        return None
    labels, centers, lows, highs, colors, bold = [], [], [], [], [], []
    for r in rows.to_dict("records"):
        top = r["by"] == "all"
        change = r.get("kernel_change")
        swap = f" (kernel {change})" if isinstance(change, str) and change else ""
        labels.append(
            f"{r['factor']}: {r['alternative']} vs {r['baseline']}{swap}"
            if top
            else f"    {r['by']}={r['value']}"
        )
        c = float(r["ratio"])
        lo, hi = float(r["ratio_ci_low"]), float(r["ratio_ci_high"])
        centers.append(c)
        lows.append(c - lo if lo == lo else 0.0)
        highs.append(hi - c if hi == hi else 0.0)
        colors.append(VERDICT_COLORS.get(r["verdict"], "#757575"))
        bold.append(top)
    fig, ax = plt.subplots(figsize=(8.5, 0.26 * len(labels) + 1.0))
    y = np.arange(len(labels))
    for i in range(len(labels)):
        ax.errorbar(
            centers[i],
            y[i],
            xerr=[[lows[i]], [highs[i]]],
            fmt="D" if bold[i] else "o",
            color=colors[i],
            markersize=6 if bold[i] else 4,
            capsize=2,
            linewidth=1.6 if bold[i] else 1.0,
        )
    ax.axvline(1, color="black", linewidth=0.8)
    ax.set_xscale("log")
    low, high = ax.get_xlim()
    ticks = [t for t in FOREST_TICKS if low <= t <= high]
    while len(ticks) > 9:  # a readable axis whatever the range
        ticks = ticks[::2] if 1 in ticks[::2] else ticks[1::2]
    ax.set_xticks(ticks, [f"{t:g}x" for t in ticks])
    ax.xaxis.set_minor_locator(mticker.NullLocator())
    ax.set_yticks(y, labels, fontsize=8)
    for tick, b in zip(ax.get_yticklabels(), bold):
        tick.set_fontweight("bold" if b else "normal")
    ax.invert_yaxis()
    ax.set_xlabel(
        "baseline time / alternative time (right of 1: the alternative is faster); 95% interval"
    )
    ax.set_title("What does each factor buy, and how sure is that?", loc="left")
    ax.grid(axis="x", which="major", alpha=0.3)
    return png(fig)
