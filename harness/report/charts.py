"""The report's figures that are not lines along a swept key: the speedup heatmap (ways x
shapes) and the effects' forest plot, each a function of its table returning an inlined PNG
(base64), or None when the table is empty.
"""

from __future__ import annotations

import math

import matplotlib

matplotlib.use("Agg")  # no display; must precede pyplot
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker as mticker  # noqa: E402
from matplotlib.colors import LogNorm  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from harness.report.busy import contended  # noqa: E402
from harness.report.figures import MIN_W, REFERENCE_NAME, busy_note, png  # noqa: E402
from harness.report.race import yours  # noqa: E402
from harness.report.ways import way_name as way_label  # noqa: E402

SPEEDUP = ("speedup_ci_low", "speedup_ci_high")
LATENCY = ("latency_ms_ci_low", "latency_ms_ci_high")


def speedup_heatmap(
    speedups: pd.DataFrame,
    low: pd.DataFrame | None = None,
    high: pd.DataFrame | None = None,
    busy: pd.DataFrame | None = None,
) -> str | None:
    """Ways of writing (rows, fastest first: by their geometric-mean speedup over the shapes) x
    shapes (columns): nn.MHA's latency / the way's, paired in the same rounds; >1 is faster.
    Each cell is one row, annotated with its 95% interval; the colour scale is logarithmic,
    centred on 1x and labelled in x (0.5x, 1x, 2x)."""
    if speedups.empty or speedups.shape[1] == 0:
        return None
    values = fastest_first(speedups)
    annot = values.map(lambda v: "" if v != v else f"{v:.2f}")
    if low is not None and high is not None:
        for r in annot.index:
            for c in annot.columns:
                lo, hi = low.loc[r, c], high.loc[r, c]
                if annot.loc[r, c] and lo == lo and hi == hi:
                    annot.loc[r, c] += f"\n{lo:.2f}-{hi:.2f}"
    cells = 0
    if busy is not None:  # timed on a busy machine: said in the cell, counted in the title
        for r in annot.index:
            for c in annot.columns:
                if annot.loc[r, c] and r in busy.index and c in busy.columns and busy.loc[r, c]:
                    annot.loc[r, c] += "\nbusy"
                    cells += 1
    width = min(30, max(MIN_W - 2, 2 + 0.85 * values.shape[1]))  # with its labels, >= 700 px
    height = min(20, 1.5 + 0.6 * values.shape[0])
    reach = float(np.nanmax(np.abs(np.log2(values.where(values > 0)).to_numpy())))
    reach = 2.0 ** max(reach, math.log2(1.25))  # at least 0.8x-1.25x, symmetric around 1x
    import seaborn as sns  # here only: it imports scipy (0.6 s), which no other figure needs

    fig, ax = plt.subplots(figsize=(width, height))
    sns.heatmap(  # its rows name nn.MHA as every other figure does, not "reference"
        values.rename(index=way_label),
        annot=annot.rename(index=way_label),
        fmt="",
        cmap="RdBu",
        norm=LogNorm(vmin=1 / reach, vmax=reach),
        cbar_kws={"label": "speedup over nn.MultiheadAttention (log scale)"},
        ax=ax,
        annot_kws={"fontsize": 7},
    )
    ticks = nice_ticks(1 / reach, reach, 7)
    ax.collections[0].colorbar.set_ticks(ticks, labels=[f"{t:g}x" for t in ticks])
    ax.collections[0].colorbar.ax.yaxis.set_minor_locator(mticker.NullLocator())
    ax.set_xlabel("shape")
    ax.set_ylabel("")
    ax.tick_params(axis="x", labelrotation=90, labelsize=7)
    ax.set_title(
        "Which ways beat nn.MultiheadAttention, at which shapes?"
        + (
            f" [{cells} cell{'s' * (cells > 1)} busy: timed on a busy machine, deciding nothing]"
            if cells
            else ""
        ),
        loc="left",
    )
    return png(fig)


def fastest_first(speedups: pd.DataFrame) -> pd.DataFrame:
    """The heatmap's rows in order of their geometric-mean speedup over the shapes, fastest
    first (a way missing at a shape is averaged over the shapes it ran at)."""
    values = speedups.astype(float)
    order = np.log(values.where(values > 0)).mean(axis=1).sort_values(ascending=False).index
    return values.loc[order]


# Ticks in the order they are wanted on a log axis of ratios (nice_ticks): 1 first, then the
# round numbers, then the finer steps that fit between them.
NICE = [1, 2, 0.5, 10, 0.1, 100, 0.01, 5, 0.2, 20, 0.05, 50, 1.5, 0.7, 3, 0.3, 1.25, 0.8]
NICE += [1.1, 0.9, 30, 0.03, 200, 500, 1000, 0.005, 0.002, 0.001]


def nice_ticks(low: float, high: float, most: int = 8) -> list[float]:
    """At most ``most`` ticks between ``low`` and ``high`` on a log axis, 1 first and then the
    roundest ratios, none closer to another than 1/``most`` of the axis (no overlapping labels:
    "0.5x 1x 2x" on a narrow axis)."""
    span = math.log10(high / low)
    chosen: list[float] = []
    for t in NICE:
        if low <= t <= high and all(abs(math.log10(t / c)) >= span / most for c in chosen):
            chosen.append(t)
    return sorted(chosen)


VERDICT_COLORS = {"faster": "#1565c0", "slower": "#c62828", "tie": "#757575"}
FOREST_SPLITS = ("dtype", "mask")
# How far past the centres (and 1x) an interval is drawn before it is clipped at the axis' edge and
# marked with an arrow: one huge interval must not squash every other line.
CLIP = 2.0


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
    lo_edge = min(min(centers), 1.0) / CLIP  # the axis: the centres and 1x, and as much of the
    hi_edge = max(max(centers), 1.0) * CLIP  # intervals as fits within CLIP of them
    bounds = [c - d for c, d in zip(centers, lows)] + [c + d for c, d in zip(centers, highs)]
    lo_edge = max(lo_edge, min(b for b in bounds if b > 0) / 1.05)
    hi_edge = min(hi_edge, max(bounds) * 1.05)
    fig, ax = plt.subplots(figsize=(8.5, 0.26 * len(labels) + 1.0))
    y = np.arange(len(labels))
    clipped = 0
    for i in range(len(labels)):
        left, right = centers[i] - lows[i], centers[i] + highs[i]
        cut_left, cut_right = left < lo_edge, right > hi_edge
        clipped += cut_left or cut_right
        ax.errorbar(
            centers[i],
            y[i],
            xerr=[[centers[i] - max(left, lo_edge)], [min(right, hi_edge) - centers[i]]],
            fmt="D" if bold[i] else "o",
            color=colors[i],
            markersize=6 if bold[i] else 4,
            capsize=2,
            linewidth=1.6 if bold[i] else 1.0,
        )
        for cut, edge, marker in ((cut_left, lo_edge, "<"), (cut_right, hi_edge, ">")):
            if cut:  # the interval goes on past the axis: an arrow at the edge says so
                ax.plot(edge, y[i], marker=marker, color=colors[i], markersize=7, clip_on=False)
    ax.axvline(1, color="black", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_xlim(lo_edge, hi_edge)
    ticks = nice_ticks(lo_edge, hi_edge)
    ax.set_xticks(ticks, [f"{t:g}x" for t in ticks])
    ax.xaxis.set_minor_locator(mticker.NullLocator())
    ax.set_yticks(y, labels, fontsize=8)
    for tick, b in zip(ax.get_yticklabels(), bold):
        tick.set_fontweight("bold" if b else "normal")
    ax.invert_yaxis()
    ax.set_xlabel(
        "baseline time / alternative time (right of 1: the alternative is faster); 95% interval"
        + (f"; {clipped} cut at the edge (arrow): see the table" if clipped else "")
    )
    ax.set_title("What does each factor buy, and how sure is that?", loc="left")
    ax.grid(axis="x", which="major", alpha=0.3)
    return png(fig)


RANKED_SHAPES = 12  # panels drawn at most; ranking.csv has every shape
CONTENDER, OTHER, REFERENCE, YOURS = "#1565c0", "#9e9e9e", "black", "#e65100"


def _ranked_panel(ax, rows: pd.DataFrame) -> None:
    """One shape's ways, fastest first, each with its 95% interval: blue where its interval
    reaches the best's (a contender), grey where it does not, nn.MultiheadAttention black."""
    speedup = pd.to_numeric(rows["speedup"], errors="coerce") if "speedup" in rows else None
    by_speed = speedup is not None and speedup.notna().all()
    col, ci = ("speedup", SPEEDUP) if by_speed else ("latency_ms_median", LATENCY)
    rows = rows.assign(_v=pd.to_numeric(rows[col], errors="coerce")).dropna(subset=["_v"])
    rows = rows.sort_values("_v", ascending=not by_speed)
    v = rows["_v"].to_numpy(float)
    lo, hi = (  # rows without an interval (fewer than 2 rounds, older files): a point
        pd.to_numeric(rows[c] if c in rows else rows["_v"], errors="coerce")
        .fillna(rows["_v"])
        .to_numpy(float)
        for c in ci
    )
    best_lo, best_hi = lo[0], hi[0]
    names = [way_label(w) for w in rows["way"]]
    mine = [yours(r) for r in rows.to_dict("records")]
    y = np.arange(len(rows))
    busy = contended(rows).to_numpy(bool)
    for i, name in enumerate(names):
        reaches = hi[i] >= best_lo if by_speed else lo[i] <= best_hi
        color = REFERENCE if name == REFERENCE_NAME else (CONTENDER if reaches else OTHER)
        ax.errorbar(
            v[i], y[i], xerr=[[v[i] - lo[i]], [hi[i] - v[i]]], fmt="o", color=color,
            markersize=6 if busy[i] else 4, capsize=2, linewidth=1.2,
            markerfacecolor="white" if busy[i] else color,  # hollow: busy (figures.BUSY_NOTE)
        )  # fmt: skip
    names = [f"{n} (busy)" if b else n for n, b in zip(names, busy)]
    if by_speed:
        ax.axvline(1, color="black", linewidth=0.8)
    ax.set_xscale("log")
    low, high = ax.get_xlim()
    ticks = nice_ticks(low, high, 6) if by_speed else []
    if ticks:
        ax.set_xticks(ticks, [f"{t:g}x" for t in ticks])
        ax.xaxis.set_minor_locator(mticker.NullLocator())
    ax.set_yticks(y, names, fontsize=7)
    for label, m in zip(ax.get_yticklabels(), mine):
        if m:  # a module of yours (race.yours): its name in orange and bold
            label.set_color(YOURS)
            label.set_fontweight("bold")
    ax.invert_yaxis()
    ax.set_xlabel(
        "speedup over nn.MHA (95% interval)" if by_speed else "latency (ms, 95% interval)"
    )
    ax.grid(axis="x", which="major", alpha=0.3)


def ranked(timed: pd.DataFrame) -> str | None:
    """Every way at each shape, fastest first, with its interval: a panel per shape (in sweep
    order, at most RANKED_SHAPES), labelled by the way alone (the shape is the panel's title)."""
    shapes = [s for s, g in timed.groupby("shape", sort=False) if g["way"].nunique() > 1]
    if not shapes:
        return None
    shown = shapes[:RANKED_SHAPES]
    ncols = 1 if len(shown) == 1 else 2
    nrows = math.ceil(len(shown) / ncols)
    most = max(int((timed["shape"] == s).sum()) for s in shown)
    fig, grid = plt.subplots(
        nrows, ncols, figsize=(6.5 * ncols, nrows * (1.6 + 0.2 * most)), squeeze=False
    )
    for ax, shape in zip(grid.flat, shown):
        _ranked_panel(ax, timed[timed["shape"] == shape])
        ax.set_title(shape, loc="left", fontsize=9)
    for ax in list(grid.flat)[len(shown) :]:
        ax.set_visible(False)
    more = f" (the first {len(shown)} of {len(shapes)} shapes)" if len(shapes) > len(shown) else ""
    fig.tight_layout()
    # above the panels, after the layout (png's tight bounding box takes it in): tight_layout
    # left too little room for it in a tall figure, and it overlapped the first panel's title
    fig.suptitle(f"Which way is fastest at each shape, and how sure is that?{more}"
                 f"{busy_note(timed[timed['shape'].isin(shown)])}",
                 x=0.01, ha="left", y=1.0, va="bottom")  # fmt: skip
    return png(fig)
