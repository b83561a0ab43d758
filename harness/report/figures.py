"""The report's figures (matplotlib and seaborn), each a function of the rows returning inlined
PNGs (base64), or raising NotDrawn with the reason when the rows cannot make it.

Line figures (``lines``) draw the ways along their choices (harness/report/encoding.py): at most
MAX_LINES lines in a panel, a legend per encoding, nn.MultiheadAttention in every panel, and a
title that is the question the figure answers. Each is at least MIN_W inches (700 px) wide.
"""

from __future__ import annotations

import base64
import io
import math
from dataclasses import dataclass

import matplotlib

matplotlib.use("Agg")  # no display; must precede pyplot
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker as mticker  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402

from matplotlib.container import ErrorbarContainer  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402

from harness.report.encoding import (  # noqa: E402
    MAX_COLS,
    MAX_LINES,
    PREFIX,
    Encoding,
    combos,
    encode,
    is_reference,
    key_text,
    label,
    name,
    order,
    plain,
    shape_splits,
    text,
    with_choices,
)

MAX_FIGURES = 8  # figures per kind, so a huge sweep still renders in seconds
PANEL_W, PANEL_H, MIN_W = 3.6, 2.6, 7.0  # inches at 100 dpi: a figure is at least 700 px wide
LINESTYLES = ["-", "--", ":", "-."]
MARKERS = ["o", "s", "^", "D", "v", "P"]
REFERENCE_NAME = "nn.MultiheadAttention"


@dataclass
class Figure:
    """A drawn figure: its title (the question it answers, and the values it is drawn for), the
    PNG (base64), and what a reader must tell apart in it, counted on the drawn figure: entries
    of its largest legend, lines of its fullest panel."""

    title: str
    png: str
    legend: int = 0
    lines: int = 0
    x: str = ""  # the column along the x axis


class NotDrawn(Exception):
    """Nothing to draw for these rows; the message says why (the report shows it)."""


def png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def finish(fig, title: str, x: str = "") -> Figure:
    """The figure measured (legend entries, lines per panel), then rendered and closed."""
    legend = max((len(leg.get_texts()) for leg in fig.legends), default=0)
    lines = max(
        (sum(isinstance(c, ErrorbarContainer) for c in ax.containers) for ax in fig.axes), default=0
    )
    return Figure(title, png(fig), legend, lines, x)


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


def plain_log_y(ax) -> None:
    """Plain numbers on a log y axis (2, 30, 0.5), not 3x10^0 or 1e-01."""
    ax.yaxis.set_major_formatter(PlainLog(labelOnlyBase=False))
    ax.yaxis.set_minor_formatter(PlainLog(labelOnlyBase=False, minor_thresholds=(1, 0.4)))


# -- what a line figure draws: its figures, panels and lines (pandas only) -------------------------


@dataclass
class Plan:
    """A line figure's rows laid out: the encoding, and a (title, rows) per figure drawn (the
    first MAX_FIGURES of ``total``)."""

    enc: Encoding
    groups: list[tuple[str, pd.DataFrame]]
    total: int


def plan(rows: pd.DataFrame, x: str, y: str, panel: str | None = None) -> Plan:
    """Lay out ``y`` against ``x``. A configuration swept at one value of ``x`` has no line and
    is left out; NotDrawn when none is left."""
    if y not in rows.columns or x not in rows.columns or not rows[y].notna().any():
        raise NotDrawn(f"no row has {y}")
    data = with_choices(rows[rows[y].notna() & rows[x].notna()])
    configs = shape_splits(data, [x, "way"])
    if configs:
        swept = data.groupby([key_text(data, k) for k in configs])[x].transform("nunique")
        data = data[swept > 1]
    elif data[x].nunique() < 2:
        data = data.iloc[0:0]
    if data.empty:
        raise NotDrawn(f"the sweep has one {x} per configuration: no line to draw along it")
    enc = encode(data, x, panel)
    crowded = (
        combos(data[~is_reference(data)], enc.in_panel())
        + data.loc[is_reference(data), "way"].nunique()
    )
    if crowded > MAX_LINES:  # a line per way beyond MAX_LINES is not a figure anyone reads
        raise NotDrawn(f"{crowded} lines in a panel (at most {MAX_LINES} are drawn)")
    if not enc.split:
        groups = [("", data)]
    else:
        groups = [
            (" ".join(label(k, key_text(g, k).iloc[0]) for k in enc.split), g)
            for _, g in data.groupby([key_text(data, k) for k in enc.split], sort=True)
        ]
    for _, g in groups:
        check_cells(g, enc, x)
    return Plan(enc, groups[:MAX_FIGURES], len(groups))


def check_cells(data: pd.DataFrame, enc: Encoding, x: str) -> None:
    """One row per mark: rows that would share a mark are refused rather than averaged."""
    ref = is_reference(data)
    shape = [k for k in (*enc.panels(), *enc.split) if not k.startswith(PREFIX)]
    for part, keys in (
        (data[~ref], [x, *enc.panels(), *enc.in_panel(), *enc.split]),
        (data[ref], [x, "way", *shape]),
    ):
        dup = part.duplicated(keys, keep=False)
        if dup.any():
            raise ValueError(
                f"{int(dup.sum())} rows share one configuration ({', '.join(map(name, keys))}); "
                "a figure would have to average them"
            )


def _panels(data: pd.DataFrame, enc: Encoding) -> tuple[int, list[tuple[str, pd.DataFrame]]]:
    """Columns of the grid, and (title, rows) per panel in reading order. nn.MultiheadAttention's
    rows are in every panel of a choice (it has none) and in their own panel of a shape key."""
    ref = is_reference(data)

    def values(key: str | None) -> list:
        if key is None:
            return [None]
        return order(key_text(data[~ref] if _is_choice(key) else data, key))

    def select(part: pd.DataFrame, key: str | None, value) -> pd.DataFrame:
        if key is None:
            return part
        keep = key_text(part, key) == value
        return part[keep | is_reference(part)] if _is_choice(key) else part[keep]

    cols, rows = values(enc.col), values(enc.row)
    out = []
    for r in rows:
        for c in cols:
            part = select(select(data, enc.row, r), enc.col, c)
            if len(part):
                parts = ((enc.col, c), (enc.row, r))
                out.append((" · ".join(label(k, v) for k, v in parts if k is not None), part))
    ncols = len(cols) if enc.row is not None else min(len(out), MAX_COLS)
    return max(ncols, 1), out


def _is_choice(column: str | None) -> bool:
    return bool(column) and column.startswith(PREFIX)


def _legend(fig, groups: list[tuple[str, list]]) -> None:
    """One legend per encoding, stacked at the right of the panels."""
    renderer = fig.canvas.get_renderer()
    top = 1.0
    for title, handles in groups:
        if not handles:
            continue
        leg = fig.legend(
            handles=handles,
            title=title,
            loc="upper left",
            bbox_to_anchor=(1.0, top),
            frameon=False,
            fontsize=8,
            title_fontsize=8,
            alignment="left",
        )
        top -= leg.get_window_extent(renderer).height / fig.bbox.height + 0.02


def lines(
    rows: pd.DataFrame,
    x: str,
    y: str,
    question: str,
    ylabel: str,
    xlabel: str,
    *,
    logx: bool = True,
    logy: bool = True,
    interval: tuple[str, str] | None = None,
    panel: str | None = None,
    ceiling: tuple[str, str] | None = None,
) -> list[Figure]:
    """``y`` against ``x`` along the ways' choices (harness/report/encoding.py): a line per
    combination of the in-panel choices, nn.MultiheadAttention in black in every panel, the 95%
    ``interval`` columns as error bars, ``ceiling`` (column, label) as a dashed line at its
    median in each panel. ``x`` is numeric (log axis ticked at its values when ``logx``) or text
    (a point per value, in ``order``)."""
    p = plan(rows, x, y, panel)
    enc = p.enc
    data = pd.concat([g for _, g in p.groups])
    ours = data[~is_reference(data)]
    levels = {k: order(text(ours[k])) for k in enc.in_panel()}
    palette = sns.color_palette("tab10", max(len(levels.get(enc.hue, [])), 1))
    categorical = not pd.api.types.is_numeric_dtype(data[x])
    x_levels = order(text(data[x])) if categorical else []
    refs = order(data.loc[is_reference(data), "way"].unique())
    ref_keys = [
        c
        for c in data.columns
        if c.startswith(PREFIX) and data.loc[is_reference(data), c].nunique() > 1
    ]

    def xs(part: pd.DataFrame) -> np.ndarray:
        if categorical:
            return np.array([x_levels.index(v) for v in text(part[x])], dtype=float)
        return part[x].to_numpy(float)

    def draw(ax, part: pd.DataFrame, **style) -> None:
        part = part.assign(_x=xs(part)).sort_values("_x")
        yerr = None
        if interval and interval[0] in part and part[interval[0]].notna().any():
            lo = (part[y] - part[interval[0]]).clip(lower=0).fillna(0).to_numpy(float)
            hi = (part[interval[1]] - part[y]).clip(lower=0).fillna(0).to_numpy(float)
            yerr = [lo, hi]
        ax.errorbar(
            part["_x"].to_numpy(float),
            part[y].to_numpy(float),
            yerr=yerr,
            markersize=4.5,
            capsize=2.5,
            elinewidth=0.9,
            **style,
        )

    def ref_style(way: str, part: pd.DataFrame) -> dict:
        s = LINESTYLES[refs.index(way) % len(LINESTYLES)]
        if enc.style and enc.style in ref_keys:  # compiled nn.MHA dashed like the compiled ways
            value = part[enc.style].iloc[0]
            if value in levels[enc.style]:
                s = LINESTYLES[levels[enc.style].index(value) % len(LINESTYLES)]
        return dict(color="black", linestyle=s, marker="x", linewidth=1.3)

    figures = []
    for title, group in p.groups:
        ncols, panels = _panels(group, enc)
        nrows = math.ceil(len(panels) / ncols)
        width = max(PANEL_W, MIN_W / ncols)
        fig, axes = plt.subplots(
            nrows, ncols, figsize=(width * ncols, PANEL_H * nrows), squeeze=False, sharey=True
        )
        for ax in axes.flat[len(panels) :]:
            ax.set_visible(False)
        for ax, (ptitle, part) in zip(axes.flat, panels):
            for way_name in refs:
                mine = part[part["way"] == way_name]
                if len(mine):
                    draw(ax, mine, **ref_style(way_name, mine))
            mine = part[~is_reference(part)]
            keys = enc.in_panel()
            drawn = [((), mine)] if not keys else mine.groupby(keys, sort=False)
            for values, line in drawn:
                if line.empty:
                    continue
                values = values if isinstance(values, tuple) else (values,)
                v = dict(zip(keys, values))
                draw(
                    ax,
                    line,
                    color=palette[levels[enc.hue].index(v[enc.hue])] if enc.hue else palette[0],
                    linestyle=LINESTYLES[levels[enc.style].index(v[enc.style]) % 4]
                    if enc.style
                    else "-",
                    marker=MARKERS[levels[enc.marker].index(v[enc.marker]) % len(MARKERS)]
                    if enc.marker
                    else "o",
                    linewidth=1.5,
                )
            if ceiling and ceiling[0] in part and part[ceiling[0]].notna().any():
                ax.axhline(
                    float(part[ceiling[0]].median()), color="#c62828", linestyle="--", linewidth=1
                )
            ax.set_title(ptitle, fontsize=9)
            if categorical:
                ax.set_xticks(range(len(x_levels)), x_levels)
                ax.set_xlim(-0.4, len(x_levels) - 0.6)
            elif logx:
                ax.set_xscale("log")
                swept_ticks(ax, part[x])
            if logy:
                ax.set_yscale("log")
                plain_log_y(ax)
            ax.grid(alpha=0.25, which="major")
        for ax in axes[:, 0]:
            ax.set_ylabel(ylabel)
        for ax in axes.flat[max(0, len(panels) - ncols) : len(panels)]:  # the bottom row drawn
            ax.set_xlabel(xlabel)
        caption = question + (f" ({title})" if title else "")
        if p.total > len(p.groups) and title == p.groups[-1][0]:
            caption += f"; {p.total - len(p.groups)} more figures of this kind not drawn"
        fig.tight_layout()
        fig.suptitle(caption, fontsize=11, x=0.01, ha="left", y=1.0, va="bottom")
        grey = "#555"
        legends = [
            (
                name(enc.hue) if enc.hue else "way",
                [
                    Line2D([], [], color=palette[i], marker="o", label=str(v))
                    for i, v in enumerate(levels[enc.hue])
                ]
                if enc.hue
                else [
                    Line2D([], [], color=palette[0], marker="o", label=str(w))
                    for w in ours["way"].unique()[:1]
                ],
            ),
            (
                name(enc.style or ""),
                [
                    Line2D([], [], color=grey, linestyle=LINESTYLES[i % 4], label=str(v))
                    for i, v in enumerate(levels.get(enc.style, []))
                ],
            ),
            (
                name(enc.marker or ""),
                [
                    Line2D([], [], color=grey, marker=MARKERS[i % len(MARKERS)], ls="", label=v)
                    for i, v in enumerate(levels.get(enc.marker, []))
                ],
            ),
            (
                REFERENCE_NAME,
                [
                    Line2D(
                        [],
                        [],
                        label=" ".join(label(k, mine[k].iloc[0]) for k in ref_keys) or "eager",
                        **ref_style(w, mine),
                    )
                    for w in refs
                    for mine in [data[data["way"] == w]]
                ],
            ),
            (
                "ceiling",
                [Line2D([], [], color="#c62828", linestyle="--", label=ceiling[1])]
                if ceiling
                else [],
            ),
        ]
        _legend(fig, legends)
        figures.append(finish(fig, caption, x))
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
    ax.set_title("What does each choice buy, and how sure is that?", loc="left")
    ax.grid(axis="x", which="major", alpha=0.3)
    return png(fig)
