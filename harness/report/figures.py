"""The report's seaborn figures, each a function of the rows returning an inlined PNG (base64)
or None when the rows cannot make that figure (too few points, column missing).

pandas 3 string columns break seaborn 0.13.2's ``hue_order``: every column used for hue,
style, row or col is made a Categorical first (``_categorical``).
"""

from __future__ import annotations

import base64
import io

import matplotlib

matplotlib.use("Agg")  # no display; must precede pyplot
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker as mticker  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402

from harness.results import SHAPE_KEYS, WAY_KEYS  # noqa: E402

MAX_PANELS = 8  # figures per kind, so a huge sweep still renders in seconds


def png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _categorical(series: pd.Series) -> pd.Categorical:
    values = series.map(lambda v: "n/a" if pd.isna(v) else str(v)).astype(object)
    return pd.Categorical(values, categories=sorted(values.unique()))


def _prepare(df: pd.DataFrame, *cats: str) -> pd.DataFrame:
    out = df.copy()
    for c in cats:
        if c in out.columns:
            out[c] = _categorical(out[c])
    return out


def split_keys(data: pd.DataFrame, encoded: list[str]) -> list[str]:
    """Configuration keys that vary among rows a figure would otherwise draw in one place: each
    becomes a figure of its own, so no mark ever stands for an average of different
    configurations. A key that the encoded ones determine (kv_seq_len = seq_len without
    cross-attention) does not split."""
    split: list[str] = []
    encoded = [k for k in encoded if k in data.columns]
    for key in SHAPE_KEYS:
        if key in encoded or key not in data.columns:
            continue
        by = [data[k].astype(str).fillna("nan") for k in encoded + split]
        counts = (
            data[key].astype(str).fillna("nan").groupby(by).nunique()
            if by
            else pd.Series([data[key].astype(str).fillna("nan").nunique()])
        )
        if len(counts) and counts.max() > 1:
            split.append(key)
    return split


def _groups(data: pd.DataFrame, encoded: list[str]) -> tuple[list[tuple[str, pd.DataFrame]], int]:
    """One group per combination of the split keys, titled with every key that varies in the
    sweep and is constant in the group; and how many groups there were before the cap."""
    split = split_keys(data, encoded)
    if not split:
        return [("", data)], 1
    varying = [
        k
        for k in SHAPE_KEYS
        if k not in encoded
        and k in data.columns
        and data[k].astype(str).fillna("nan").nunique() > 1
    ]
    out = []
    for _, group in data.groupby(
        [data[k].astype(str).fillna("nan") for k in split], sort=True, dropna=False
    ):
        title = " ".join(
            f"{k}={plain(group[k].iloc[0])}"
            for k in varying
            if group[k].astype(str).fillna("nan").nunique() == 1 and not pd.isna(group[k].iloc[0])
        )
        out.append((title, group))
    return out[:MAX_PANELS], len(out)


def plain(value) -> str:
    """A value as a person writes it: 2048, not 2048.0 (a column with missing values is float)."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


class PlainLog(mticker.LogFormatter):
    """The log ticks matplotlib would label, written as plain numbers (0.1, 2, 30), not 1e-01."""

    def __call__(self, x, pos=None):
        return f"{x:g}" if super().__call__(x, pos) else ""


def swept_ticks(ax, values) -> None:
    """A log x axis ticked at the swept values, labelled plainly (128, 1024), with no minor
    labels: matplotlib's own would overlap ("2x10^2 3x10^4x10^2")."""
    ticks = sorted({float(v) for v in values if not pd.isna(v)})
    ax.xaxis.set_major_locator(mticker.FixedLocator(ticks))
    ax.xaxis.set_major_formatter(mticker.FixedFormatter([plain(t) for t in ticks]))
    ax.xaxis.set_minor_locator(mticker.NullLocator())


def _one_per_cell(data: pd.DataFrame, cell: list[str]) -> None:
    dup = data.duplicated([c for c in cell if c in data.columns], keep=False)
    if dup.any():  # the rows hold the same configuration twice: refuse rather than average them
        raise ValueError(
            f"{int(dup.sum())} rows share one configuration ({', '.join(cell)}); "
            "a figure would have to average them"
        )


def _draw_lines(
    data: pd.DataFrame,
    x: str,
    y: str,
    hue: str,
    style: str | None,
    low: str | None,
    high: str | None,
    color=None,
    label=None,
    **_,
):
    """One facet: a line per (hue, style) level, with its 95% interval as error bars."""
    ax = plt.gca()
    styles = list(data[style].cat.categories) if style else [None]
    for s in styles:
        part = data[data[style] == s] if style else data
        if part.empty:
            continue
        part = part.sort_values(x)
        ls = LINESTYLES[styles.index(s) % len(LINESTYLES)]
        yerr = None
        if low and high and low in part and part[low].notna().any():
            lo = (part[y] - part[low]).clip(lower=0).fillna(0)
            hi = (part[high] - part[y]).clip(lower=0).fillna(0)
            yerr = [lo.to_numpy(float), hi.to_numpy(float)]
        ax.errorbar(
            part[x].to_numpy(float),
            part[y].to_numpy(float),
            yerr=yerr,
            color=color,
            linestyle=ls,
            marker="o",
            markersize=4,
            capsize=3,
            linewidth=1.4,
            elinewidth=1,
        )


LINESTYLES = ["-", "--", ":", "-."]


def line_vs_seq_len(
    timed: pd.DataFrame,
    y: str,
    ylabel: str,
    logy: bool = True,
    interval: tuple[str, str] | None = None,
) -> list[tuple[str, str]]:
    """``y`` vs seq_len, a line per way of writing, panels by dtype (cols) and num_heads (rows),
    mask as line style, the 95% ``interval`` columns as error bars. Every other configuration
    key that varies splits the figure (``split_keys``): one row per mark, never an average."""
    timed = timed[timed[y].notna()] if y in timed.columns else timed.iloc[0:0]
    if timed.empty:
        return []
    encoded = ["seq_len", "way", "mask", "dtype", "num_heads", *WAY_KEYS]
    groups, total = _groups(timed, encoded)
    figures = []
    for title, group in groups:
        _one_per_cell(group, ["seq_len", "way", "mask", "dtype", "num_heads"])
        # missing values: category "n/a"
        data = _prepare(group, "way", "dtype", "num_heads", "mask")
        style = "mask" if data["mask"].nunique() > 1 else None
        row = "num_heads" if data["num_heads"].nunique() > 1 else None
        ways = list(data["way"].cat.categories)
        palette = sns.color_palette("tab10" if len(ways) <= 10 else "husl", len(ways))
        g = sns.FacetGrid(
            data,
            col="dtype",
            row=row,
            hue="way",
            palette=palette,
            height=3.0,
            aspect=1.3,
            sharey=False,
            margin_titles=True,
        )
        g.map_dataframe(
            _draw_lines,
            x="seq_len",
            y=y,
            hue="way",
            style=style,
            low=interval[0] if interval else None,
            high=interval[1] if interval else None,
        )
        g.set(xscale="log")
        for ax in g.axes.flat:
            swept_ticks(ax, data["seq_len"])
        if logy:
            g.set(yscale="log")
            for ax in g.axes.flat:  # plain numbers (2, 30, 0.5), not 3x10^0 or 1e-01
                ax.yaxis.set_major_formatter(PlainLog(labelOnlyBase=False))
                minor = PlainLog(labelOnlyBase=False, minor_thresholds=(1, 0.4))
                ax.yaxis.set_minor_formatter(minor)
        g.set_axis_labels("seq_len (tokens)", ylabel)
        handles = [
            plt.Line2D([], [], color=palette[i], marker="o", label=str(w))
            for i, w in enumerate(ways)
        ]
        if style:
            handles += [
                plt.Line2D(
                    [],
                    [],
                    color="#555",
                    linestyle=LINESTYLES[i % len(LINESTYLES)],
                    label=f"mask={m}",
                )
                for i, m in enumerate(data["mask"].cat.categories)
            ]
        g.figure.legend(
            handles=handles, loc="center left", bbox_to_anchor=(1.0, 0.5), frameon=False, fontsize=8
        )
        caption = title
        if total > len(groups) and title == groups[-1][0]:
            caption += f"  ({total - len(groups)} more figures of this kind not drawn)"
        if caption:
            g.figure.suptitle(caption, y=1.02)
        figures.append((title, png(g.figure)))
    return figures


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
    width = min(30, 2 + 0.85 * speedups.shape[1])
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
    return png(fig)


def compile_bars(rows: pd.DataFrame, max_bars: int = 40) -> str | None:
    """Compile time (first call, compilation included): one bar per row (way | shape), never a
    mean over shapes."""
    if "compile_s" not in rows.columns:
        return None
    data = rows[rows["compile_s"].notna()]
    if data.empty:
        return None
    total = len(data)
    data = data.head(max_bars)
    labels = [f"{w} | {s}" for w, s in zip(data["way"], data["shape"])]
    fig, ax = plt.subplots(figsize=(9, 0.3 * len(data) + 1.2))
    ax.barh(range(len(data)), data["compile_s"].astype(float), color="#5c6bc0")
    ax.set_yticks(range(len(data)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel(
        "compile time, first call (s)"
        + (f"; first {max_bars} rows of {total}" if total > max_bars else "")
    )
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
        labels.append(
            f"{r['choice']}: {r['alternative']} vs {r['baseline']}"
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
    ax.grid(axis="x", which="major", alpha=0.3)
    return png(fig)
