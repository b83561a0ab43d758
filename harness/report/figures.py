"""The report's figures (matplotlib), each a function of the rows returning inlined
PNGs (base64), or raising NotDrawn with the reason when the rows cannot make it.

Line figures (``lines``) draw the ways along their factors (harness/report/encoding.py): at most
MAX_LINES lines in a panel, a legend per encoding, nn.MultiheadAttention in every panel, and a
title that is the question the figure answers. Each is at least MIN_W inches (700 px) wide.
"""

from __future__ import annotations

import base64
import io
import math
from dataclasses import dataclass, field

import matplotlib

matplotlib.use("Agg")  # no display; must precede pyplot
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker as mticker  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from matplotlib.container import ErrorbarContainer  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402

from harness.report.busy import contended  # noqa: E402
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
    ranks_of,
    shape_splits,
    text,
    with_factors,
)

MAX_FIGURES = 8  # figures per kind, so a huge sweep still renders in seconds
PANEL_W, PANEL_H, MIN_W = 3.6, 2.6, 7.0  # inches at 100 dpi: a figure is at least 700 px wide
LINESTYLES = ["-", "--", ":", "-."]
MARKERS = ["o", "s", "^", "D", "v", "P"]
REFERENCE_NAME = "nn.MultiheadAttention"
CEILING = "#c62828"  # the ceiling's dashed line


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


def tab10(n: int) -> list[tuple]:
    """n colours of matplotlib's tab10, cycling: seaborn's ``color_palette("tab10", n)``, without
    importing seaborn (and scipy under it: 0.6 s of every report) where no heatmap is drawn."""
    colours = matplotlib.colormaps["tab10"].colors
    return [tuple(colours[i % len(colours)]) for i in range(n)]


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
    data = with_factors(rows[rows[y].notna() & rows[x].notna()])
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
    rows are in every panel of a factor (it has none) and in their own panel of a shape key."""
    ref = is_reference(data)

    def values(key: str | None) -> list:
        if key is None:
            return [None]
        return order(key_text(data[~ref] if _is_factor(key) else data, key), ranks_of(data, key))

    def select(part: pd.DataFrame, key: str | None, value) -> pd.DataFrame:
        if key is None:
            return part
        keep = key_text(part, key) == value
        return part[keep | is_reference(part)] if _is_factor(key) else part[keep]

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


def _is_factor(column: str | None) -> bool:
    return bool(column) and column.startswith(PREFIX)


# -- how a line figure's lines look (its encoding drawn) ------------------------------------------


@dataclass
class Styles:
    """The look of a line figure's lines: colour by ``enc.hue``, line style by ``enc.style``,
    marker by ``enc.marker`` (each level in reading order); nn.MultiheadAttention's ways in
    black, a line style each (a compiled one dashed like the compiled ways)."""

    enc: Encoding
    levels: dict[str, list]  # in-panel factor -> its values in reading order
    palette: list
    refs: dict[str, pd.DataFrame]  # nn.MultiheadAttention's ways, in order, and their rows
    ref_keys: list[str]  # the factors in which nn.MultiheadAttention's ways differ
    first_way: str  # the way a figure with one hand-written way names in its legend

    @classmethod
    def of(cls, data: pd.DataFrame, enc: Encoding) -> Styles:
        ref = is_reference(data)
        ours = data[~ref]
        levels = {k: order(text(ours[k]), ranks_of(ours, k)) for k in enc.in_panel()}
        palette = tab10(max(len(levels.get(enc.hue, [])), 1))
        refs = {w: data[data["way"] == w] for w in order(data.loc[ref, "way"].unique())}
        keys = [c for c in data.columns if c.startswith(PREFIX) and data.loc[ref, c].nunique() > 1]
        first = str(ours["way"].iloc[0]) if len(ours) else ""
        return cls(enc, levels, palette, refs, keys, first)

    def _index(self, key: str | None, value) -> int | None:
        return self.levels[key].index(value) if key else None

    def line(self, values: dict) -> dict:
        """A hand-written way's line, from its values of the in-panel factors."""
        enc = self.enc
        slots = (enc.hue, enc.style, enc.marker)
        hue, style, marker = (self._index(k, values.get(k)) for k in slots)
        return dict(
            color=self.palette[hue] if hue is not None else self.palette[0],
            linestyle=LINESTYLES[style % len(LINESTYLES)] if style is not None else "-",
            marker=MARKERS[marker % len(MARKERS)] if marker is not None else "o",
            linewidth=1.5,
        )

    def reference(self, way: str, part: pd.DataFrame) -> dict:
        """nn.MultiheadAttention's line for ``way`` (``part``: its rows)."""
        style = LINESTYLES[list(self.refs).index(way) % len(LINESTYLES)]
        key = self.enc.style
        if key and key in self.ref_keys:
            value = part[key].iloc[0]
            if value in self.levels[key]:
                style = LINESTYLES[self.levels[key].index(value) % len(LINESTYLES)]
        return dict(color="black", linestyle=style, marker="x", linewidth=1.3)


# -- drawing ---------------------------------------------------------------------------------------


@dataclass
class Axes:
    """What a line figure draws along what: ``y`` against ``x``, the 95% ``interval`` columns as
    error bars, ``ceiling`` (column, label) as a dashed line at its median in each panel. ``x``
    is numeric (a log axis ticked at its values when ``logx``) or text (``x_levels``)."""

    x: str
    y: str
    xlabel: str
    ylabel: str
    logx: bool = True
    logy: bool = True
    interval: tuple[str, str] | None = None
    ceiling: tuple[str, str] | None = None
    x_levels: list = field(default_factory=list)  # text x: its values in order

    def xs(self, part: pd.DataFrame) -> np.ndarray:
        if self.x_levels:
            return np.array([self.x_levels.index(v) for v in text(part[self.x])], dtype=float)
        return part[self.x].to_numpy(float)


def _errorbar(ax, part: pd.DataFrame, axes: Axes, **style) -> None:
    """One line: ``part``'s rows along x, with their interval when they have one."""
    part = part.assign(_x=axes.xs(part)).sort_values("_x")
    yerr = None
    low, high = axes.interval or (None, None)
    if low in part and part[low].notna().any():
        below = (part[axes.y] - part[low]).clip(lower=0).fillna(0).to_numpy(float)
        above = (part[high] - part[axes.y]).clip(lower=0).fillna(0).to_numpy(float)
        yerr = [below, above]
    ax.errorbar(
        part["_x"].to_numpy(float),
        part[axes.y].to_numpy(float),
        yerr=yerr,
        markersize=4.5,
        capsize=2.5,
        elinewidth=0.9,
        **style,
    )
    busy = contended(part)
    if busy.any():  # timed on a busy machine: hollow, so that it is not read as a result
        ax.plot(
            part["_x"][busy].to_numpy(float),
            part[axes.y][busy].to_numpy(float),
            linestyle="none",
            marker="o",
            markersize=6.5,
            markerfacecolor="white",
            markeredgecolor=style.get("color", "grey"),
            zorder=5,
        )


# What a hollow marker means, said under every figure that has one (harness/report/busy.py).
BUSY_NOTE = "hollow: timed on a busy machine (contended), decides nothing"


def busy_note(rows: pd.DataFrame) -> str:
    """The caption's note when some of ``rows`` stayed contended ("" when none did)."""
    n = int(contended(rows).sum())
    return f" [{n} {BUSY_NOTE}]" if n else ""


def _draw_panel(ax, part: pd.DataFrame, axes: Axes, styles: Styles) -> None:
    """A panel's lines (nn.MultiheadAttention's first), its ceiling, scales and ticks."""
    for way_name in styles.refs:
        mine = part[part["way"] == way_name]
        if len(mine):
            _errorbar(ax, mine, axes, **styles.reference(way_name, mine))
    ours = part[~is_reference(part)]
    keys = styles.enc.in_panel()
    for values, line in [((), ours)] if not keys else ours.groupby(keys, sort=False):
        if not line.empty:
            values = values if isinstance(values, tuple) else (values,)
            _errorbar(ax, line, axes, **styles.line(dict(zip(keys, values))))
    ceiling = axes.ceiling
    if ceiling and ceiling[0] in part and part[ceiling[0]].notna().any():
        ax.axhline(float(part[ceiling[0]].median()), color=CEILING, linestyle="--", linewidth=1)
    if axes.x_levels:
        ax.set_xticks(range(len(axes.x_levels)), axes.x_levels)
        ax.set_xlim(-0.4, len(axes.x_levels) - 0.6)
    elif axes.logx:
        ax.set_xscale("log")
        swept_ticks(ax, part[axes.x])
    if axes.logy:
        ax.set_yscale("log")
        plain_log_y(ax)
    ax.grid(alpha=0.25, which="major")


def _figure(group: pd.DataFrame, axes: Axes, styles: Styles, caption: str) -> Figure:
    """One figure of a line plot: its panels in a grid, its caption and legends."""
    ncols, panels = _panels(group, styles.enc)
    nrows = math.ceil(len(panels) / ncols)
    width = max(PANEL_W, MIN_W / ncols)
    fig, grid = plt.subplots(
        nrows, ncols, figsize=(width * ncols, PANEL_H * nrows), squeeze=False, sharey=True
    )
    for ax in grid.flat[len(panels) :]:
        ax.set_visible(False)
    for ax, (title, part) in zip(grid.flat, panels):
        _draw_panel(ax, part, axes, styles)
        ax.set_title(title, fontsize=9)
    for ax in grid[:, 0]:
        ax.set_ylabel(axes.ylabel)
    for ax in grid.flat[max(0, len(panels) - ncols) : len(panels)]:  # the bottom row drawn
        ax.set_xlabel(axes.xlabel)
    fig.tight_layout()
    caption += busy_note(group)
    fig.suptitle(caption, fontsize=11, x=0.01, ha="left", y=1.0, va="bottom")
    _place_legends(fig, _legends(styles, axes.ceiling))
    return finish(fig, caption, axes.x)


# -- legends ---------------------------------------------------------------------------------------


def _legends(styles: Styles, ceiling: tuple[str, str] | None) -> list[tuple[str, list]]:
    """(title, handles) per encoding: colour, line style, marker, nn.MultiheadAttention's ways
    and the ceiling; an encoding not used has no handles."""
    enc, levels, grey = styles.enc, styles.levels, "#555"
    if enc.hue:
        colours = [
            Line2D([], [], color=styles.palette[i], marker="o", label=str(v))
            for i, v in enumerate(levels[enc.hue])
        ]
    else:
        colours = [Line2D([], [], color=styles.palette[0], marker="o", label=styles.first_way)]
        colours = colours if styles.first_way else []
    dashes = [
        Line2D([], [], color=grey, linestyle=LINESTYLES[i % len(LINESTYLES)], label=str(v))
        for i, v in enumerate(levels.get(enc.style, []))
    ]
    marks = [
        Line2D([], [], color=grey, marker=MARKERS[i % len(MARKERS)], ls="", label=str(v))
        for i, v in enumerate(levels.get(enc.marker, []))
    ]
    refs = [
        Line2D(
            [],
            [],
            label=" ".join(label(k, rows[k].iloc[0]) for k in styles.ref_keys) or "eager",
            **styles.reference(w, rows),
        )
        for w, rows in styles.refs.items()
    ]
    top = [Line2D([], [], color=CEILING, linestyle="--", label=ceiling[1])] if ceiling else []
    return [
        (name(enc.hue) if enc.hue else "way", colours),
        (name(enc.style or ""), dashes),
        (name(enc.marker or ""), marks),
        (REFERENCE_NAME, refs),
        ("ceiling", top),
    ]


def _place_legends(fig, groups: list[tuple[str, list]]) -> None:
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
    """``y`` against ``x`` along the ways' factors (harness/report/encoding.py): a line per
    combination of the in-panel factors, nn.MultiheadAttention in black in every panel, the 95%
    ``interval`` columns as error bars, ``ceiling`` (column, label) as a dashed line at its
    median in each panel. ``x`` is numeric (log axis ticked at its values when ``logx``) or text
    (a point per value, in ``order``)."""
    p = plan(rows, x, y, panel)
    data = pd.concat([g for _, g in p.groups])
    categorical = not pd.api.types.is_numeric_dtype(data[x])
    levels = order(text(data[x]), ranks_of(data, x)) if categorical else []
    axes = Axes(x, y, xlabel, ylabel, logx, logy, interval, ceiling, levels)
    styles = Styles.of(data, p.enc)
    out = []
    for title, group in p.groups:
        caption = question + (f" ({title})" if title else "")
        if p.total > len(p.groups) and title == p.groups[-1][0]:
            caption += f"; {p.total - len(p.groups)} more figures of this kind not drawn"
        out.append(_figure(group, axes, styles, caption))
    return out
