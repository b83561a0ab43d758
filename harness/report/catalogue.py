"""The report's figures as one list: each entry the question it answers, the rows it is drawn
from, its x axis and when it applies. The report (templates/report.html.j2) shows them in
order, a section per ``Section``; ``draw`` draws every entry that applies.

An entry that does not apply to the rows (a decode figure of a sweep that does not decode, a key
the sweep holds at one value) is listed once, with why, at the end of the figures. One whose rows
cannot make it (figures.NotDrawn: one value per configuration, too many lines) says why in its
place. One that fails (any other exception) is a bug: the page shows which figure failed and
its error, and ``strict`` (the tests) raises it.

Any key of ``AXES`` that the sweep varies gets a latency figure along it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import pandas as pd
from markupsafe import Markup

from harness import schema
from harness.report import charts, figures
from harness.report.encoding import plain
from harness.report.busy import contended
from harness.results import timed_ok

LATENCY_CI = ("latency_ms_ci_low", "latency_ms_ci_high")
SPEEDUP_CI = ("speedup_ci_low", "speedup_ci_high")
EAGER_CI = ("eager_ms_ci_low", "eager_ms_ci_high")


def decoding(rows: pd.DataFrame) -> pd.Series:
    """Which rows are decode steps against a KV cache."""
    if "kv_cache_len" not in rows.columns:
        return pd.Series(False, index=rows.index)
    return pd.to_numeric(rows["kv_cache_len"], errors="coerce").notna()


def prefill(rows: pd.DataFrame) -> pd.DataFrame:
    return rows[~decoding(rows)]


def decode(rows: pd.DataFrame) -> pd.DataFrame:
    return rows[decoding(rows)]


def window_rows(rows: pd.DataFrame) -> pd.DataFrame:
    """Causal and sliding-window prefill rows with ``attends`` ("causal", "window 128"): the x
    the window figure is drawn along (mask and window are one factor there)."""
    rows = prefill(rows)
    if "mask" not in rows.columns or not (rows["mask"] == "sliding").any():
        return rows.iloc[0:0].assign(attends=[])
    rows = rows[rows["mask"].isin(("causal", "sliding"))]
    attends = [
        "causal" if m == "causal" else f"window {plain(w)}"
        for m, w in zip(rows["mask"], rows.get("window", pd.Series(index=rows.index)))
    ]
    return rows.assign(attends=attends)


def eager(rows: pd.DataFrame) -> pd.DataFrame:
    """CUDA rows that carry the eager call time (``eager_ms_median``) beside their device time."""
    if "eager_ms_median" not in rows.columns:
        return rows.iloc[0:0]
    return rows[pd.to_numeric(rows["eager_ms_median"], errors="coerce").notna()]


def eager_over_device(rows: pd.DataFrame) -> pd.DataFrame:
    """The rows whose device time is a CUDA-graph replay (``timed_by=graph``) with their eager
    call time / device time (the replay without the L2 flush, as ``launch_bound`` compares them;
    the flushed one in rows without it), and the launch-bound ratio (schema.LAUNCH_BOUND) as a
    column for the figure's dashed line."""
    rows = eager(rows)
    if rows.empty:
        return rows
    if "timed_by" in rows.columns:
        rows = rows[rows["timed_by"].astype(str) == "graph"]
    device = pd.to_numeric(rows["latency_ms_median"], errors="coerce")
    if "replay_warm_ms_median" in rows.columns:  # like for like, as launch_bound compares them
        warm = pd.to_numeric(rows["replay_warm_ms_median"], errors="coerce")
        device = warm.where(warm.notna(), device)
    ratio = pd.to_numeric(rows["eager_ms_median"], errors="coerce") / device
    return rows.assign(eager_over_device=ratio, launch_bound_at=schema.LAUNCH_BOUND)


def speedups(df: pd.DataFrame) -> tuple[pd.DataFrame, ...]:
    """Rows: way; columns: shape; values: the correct timed rows' paired speedups over
    nn.MultiheadAttention, their 95% interval bounds, and whether each stayed contended (timed
    on a busy machine). One row per cell (a duplicate configuration raises). ``df``: rows with
    ``way`` and ``shape`` (analysis.prepare)."""
    ok = timed_ok(df)
    empty = (pd.DataFrame(), pd.DataFrame(), pd.DataFrame(), pd.DataFrame())
    if "speedup" not in ok.columns:
        return empty
    ok = ok[pd.to_numeric(ok["speedup"], errors="coerce").notna()]
    if ok.empty:
        return empty
    order = list(ok["shape"].drop_duplicates())  # sweep order, not alphabetical
    tables = [
        ok.pivot(index="way", columns="shape", values=v)[order].astype(float)
        for v in ("speedup", *SPEEDUP_CI)
    ]
    busy = ok.assign(_busy=contended(ok)).pivot(index="way", columns="shape", values="_busy")
    return tables[0], tables[1], tables[2], busy[order].fillna(False).astype(bool)


def heatmap(rows: pd.DataFrame, entry: Entry) -> str | None:
    return charts.speedup_heatmap(*speedups(rows))


def ranked(rows: pd.DataFrame, entry: Entry) -> str | None:
    return charts.ranked(rows)


def grid_of_ways(rows: pd.DataFrame) -> str:
    """Why a ways x shapes heatmap would say nothing here ("": it would)."""
    if rows["way"].nunique() < 2:
        return "one way in the sweep"
    return (
        "one shape in the sweep (the ranked chart shows its ways)"
        if rows["shape"].nunique() < 2
        else ""
    )


def several_ways(rows: pd.DataFrame) -> str:
    return "" if rows.groupby("shape")["way"].nunique().max() > 1 else "one way per shape"


def has(rows: pd.DataFrame, column: str) -> bool:
    return column in rows.columns and pd.to_numeric(rows[column], errors="coerce").notna().any()


@dataclass(frozen=True)
class Entry:
    """One figure of the report. ``y``: (column, axis label) candidates, the first that the
    rows have is drawn (the throughput: % of peak, else TFLOP/s); ``options``: figures.lines'
    keyword arguments; ``draw``: its own drawing instead of a line figure."""

    name: str  # its id in the page
    section: str  # the Section it is shown in
    question: str  # its title: the question it answers
    select: Callable[[pd.DataFrame], pd.DataFrame]  # its rows, of the correct timed rows
    x: str = ""  # the column along its x axis
    xlabel: str = ""
    y: tuple[tuple[str, str], ...] = (("latency_ms_median", "median latency (ms)"),)
    options: dict = field(default_factory=dict)
    draw: Callable[[pd.DataFrame, Entry], object] | None = None
    needs: Callable[[pd.DataFrame], str] | None = None  # why it does not apply ("": it does)

    def column(self, rows: pd.DataFrame) -> tuple[str, str]:
        return next(((c, t) for c, t in self.y if has(rows, c)), self.y[0])

    def applies(self, rows: pd.DataFrame) -> str:
        """Empty when the entry applies to ``rows`` (its selection), else why it does not."""
        if rows.empty:
            return "no row of its kind"
        y, _ = self.column(rows)
        if not has(rows, y):
            return f"no row has {y}"
        if self.x and (self.x not in rows.columns or rows[self.x].nunique() < 2):
            return f"one {self.x} in the sweep"
        return self.needs(rows) if self.needs else ""

    def figure(self, rows: pd.DataFrame):
        if self.draw is not None:
            return self.draw(rows, self)
        y, ylabel = self.column(rows)
        return figures.lines(rows, self.x, y, self.question, ylabel, self.xlabel, **self.options)


@dataclass(frozen=True)
class Section:
    id: str  # its anchor in the page
    title: str
    note: str = ""  # how to read its figures (HTML, trusted: written here)


def _all(rows: pd.DataFrame) -> pd.DataFrame:
    return rows


def along(key: str, label: str) -> Entry:
    """Latency along a shape key the sweep varies, prefill and decode rows alike."""
    return Entry(
        f"latency_{key}",
        "axes",
        f"How does each way's latency change with {key}?",
        _all,
        key,
        label,
        options=dict(interval=LATENCY_CI),
    )


LINES_NOTE = (
    "How to read the line figures: each way of writing attention is drawn by its factors, not "
    "by a colour of its own. Panels by the factor with the most values (the kernel), colour by "
    "structure, line style by compile, marker by head merge; a factor that would crowd a panel "
    "past 8 lines gets a row of panels, and every shape key that varies besides the x axis gets "
    "panels or a figure of its own, so that no mark averages different configurations. "
    "nn.MultiheadAttention is the black line in every panel (dashed: compiled). Error bars: the "
    "95% interval over the rounds, which are spread over the sweep so that drift is inside it. "
    "The full name of every way is in the table of all rows below."
)
SECTIONS = [
    Section(
        "ranked",
        "The ways at each shape, fastest first",
        "Each way's speedup over nn.MultiheadAttention (paired in the same rounds) with its 95% "
        "interval, fastest at the top: blue where the interval reaches the fastest way's (it "
        "could be the fastest on a re-run), grey where it does not, nn.MultiheadAttention in "
        "black. A shape without nn.MultiheadAttention is ranked by latency.",
    ),
    Section("figures", "Latency vs sequence length", LINES_NOTE),
    Section(
        "regime",
        "Eager call time against device time",
        "CUDA: the latency that ranks the ways is device time (each call captured once in a CUDA "
        "graph and replayed: no launch gaps). An eager call, what a Python caller waits, adds "
        "Python's kernel launches wherever the GPU finishes a kernel before the next is launched. "
        "A way at or above the dashed line (eager call time at least "
        f"{schema.LAUNCH_BOUND:g}x device time, both with the L2 as the previous call left it) "
        "is launch-bound: eager, it runs at Python's "
        "pace, and a CUDA graph, compile=reduce-overhead or a bigger batch would bring it to its "
        "device time.",
    ),
    Section(
        "speedup",
        "Speedup over nn.MultiheadAttention",
        "nn.MultiheadAttention's time / each way's, paired round by round (drift cancels), with "
        "its 95% interval: above 1 is faster.",
    ),
    Section("throughput", "Throughput"),  # its note names the peaks: render.throughput_note
    Section(
        "memory",
        "Peak memory vs sequence length",
        "Memory the call allocated beyond its inputs; the manual path grows with L·S (the "
        "score matrix).",
    ),
    Section(
        "decode",
        "Decode: one step against a growing cache",
        "A decode step reads every cached key and value once, so it is bound by memory, not "
        "arithmetic: latency should grow with the cache length, and GB/s (the bytes a step "
        "moves: weights, the cache read, the new keys and values written, input and output, "
        "over its latency) should approach the machine's measured copy bandwidth (red dashed; "
        "<code>copy_gbps</code>). nn.MultiheadAttention has no cache: it recomputes the whole "
        "sequence at every step.",
    ),
    Section(
        "grouped",
        "Grouped K/V heads",
        "Fewer K/V heads than query heads (grouped-query; one: multi-query) shrink the K/V "
        "projections and the cache; a panel per kernel, since whether a kernel uses the grouping "
        "or repeats the heads decides what it buys. nn.MultiheadAttention computes every K/V "
        "head.",
    ),
    Section(
        "window",
        "Sliding window vs causal",
        "The same prefill through a sliding window and through full causal attention, a panel "
        "per kernel: a kernel that skips the blocks outside the window (FlexAttention) should "
        "gain with the window; one that applies it as a dense mask computes every score anyway.",
    ),
    Section(
        "axes",
        "Latency along the other swept keys",
        "Every shape key the sweep varies besides those above, with the same encoding as the "
        "line figures.",
    ),
]
PEAK = (("pct_of_peak", "% of measured matmul peak"), ("tflops", "TFLOP/s"))
CATALOGUE = [
    Entry(
        "ranked",
        "ranked",
        "Which way is fastest at each shape, and how sure is that?",
        _all,
        y=(("latency_ms_median", ""),),
        draw=ranked,
        needs=several_ways,
    ),
    Entry(
        "latency",
        "figures",
        "How does each way's latency grow with the sequence length?",
        _all,
        "seq_len",
        "seq_len (tokens)",
        options=dict(interval=LATENCY_CI),
    ),
    Entry(
        "eager_latency",
        "regime",
        "What does a Python caller wait per eager call, launches included?",
        eager,
        "seq_len",
        "seq_len (tokens)",
        (("eager_ms_median", "eager call time (ms)"),),
        options=dict(interval=EAGER_CI),
    ),
    Entry(
        "eager_over_device",
        "regime",
        "How many times its device time does an eager call take (launch-bound at the line)?",
        eager_over_device,
        "seq_len",
        "seq_len (tokens)",
        (("eager_over_device", "eager call time / device time"),),
        options=dict(ceiling=("launch_bound_at", f"launch-bound: {schema.LAUNCH_BOUND:g}x")),
    ),
    Entry(
        "speedup_lines",
        "speedup",
        "How much faster than nn.MultiheadAttention is each way?",
        _all,
        "seq_len",
        "seq_len (tokens)",
        (("speedup", "speedup over nn.MHA"),),
        options=dict(interval=SPEEDUP_CI),
    ),
    Entry(
        "speedup_heatmap",
        "speedup",
        "Which ways beat nn.MultiheadAttention, at which shapes?",
        _all,
        y=(("speedup", ""),),
        draw=heatmap,
        needs=grid_of_ways,
    ),
    Entry(
        "throughput",
        "throughput",
        "How close to the machine's matmul peak does each way run?",
        _all,
        "seq_len",
        "seq_len (tokens)",
        PEAK,
        options=dict(logy=False),
    ),
    Entry(
        "memory",
        "memory",
        "How much memory does each way allocate beyond its inputs?",
        _all,
        "seq_len",
        "seq_len (tokens)",
        (("peak_mem_mb", "peak memory (MiB)"),),
    ),
    Entry(
        "decode_latency",
        "decode",
        "How does a decode step's latency grow with the cache length?",
        decode,
        "kv_cache_len",
        "cache length (tokens)",
        options=dict(interval=LATENCY_CI),
    ),
    Entry(
        "decode_gbps",
        "decode",
        "Does a decode step stream its cache at the machine's copy bandwidth?",
        decode,
        "kv_cache_len",
        "cache length (tokens)",
        (("gbps", "GB/s moved"),),
        options=dict(ceiling=("copy_gbps", "measured copy bandwidth")),
    ),
    Entry(
        "decode_grouped",
        "decode",
        "What do fewer K/V heads buy a decode step, per kernel?",
        decode,
        "num_kv_heads",
        "K/V heads",
        options=dict(interval=LATENCY_CI, panel="attention"),
    ),
    Entry(
        "grouped",
        "grouped",
        "What do fewer K/V heads buy, per kernel?",
        prefill,
        "num_kv_heads",
        "K/V heads",
        options=dict(interval=LATENCY_CI, panel="attention"),
    ),
    Entry(
        "window",
        "window",
        "What does a sliding window save against full causal attention, per kernel?",
        window_rows,
        "attends",
        "keys each query attends to",
        options=dict(interval=LATENCY_CI, panel="attention"),
    ),
    along("batch", "batch"),
    along("embed_dim", "embed_dim"),
    along("num_heads", "query heads"),
]


@dataclass
class Drawn:
    """An entry drawn: its figures (a list of figures.Figure, or one PNG), or why there is none:
    ``skipped`` (it does not apply), ``not_drawn`` (its rows cannot make it), ``error`` (it
    failed: a bug, shown in the page)."""

    entry: Entry
    figures: object = None
    skipped: str = ""
    not_drawn: str = ""
    error: str = ""


class FigureFailed(Exception):
    """A figure raised (``draw`` with ``strict``): the message names the figure."""


def draw(timed: pd.DataFrame, entries: list[Entry] | None = None, strict: bool = False):
    """Each entry of ``entries`` (the CATALOGUE) drawn from the correct timed rows."""
    out = []
    for entry in CATALOGUE if entries is None else entries:
        try:
            rows = entry.select(timed)
            why = entry.applies(rows)
            if why:
                out.append(Drawn(entry, skipped=why))
                continue
            out.append(Drawn(entry, entry.figure(rows)))
        except figures.NotDrawn as e:
            out.append(Drawn(entry, not_drawn=str(e)))
        except Exception as e:  # noqa: BLE001 - shown in the page; the rest is drawn
            if strict:
                raise FigureFailed(f"figure {entry.name!r} failed: {type(e).__name__}: {e}") from e
            out.append(Drawn(entry, error=f"{type(e).__name__}: {e}"))
    return out


def sections(drawn: list[Drawn], notes: dict[str, str] | None = None) -> list[dict]:
    """The sections that show a figure (or why one in them was not drawn), in order, each with
    its entries: what the template loops over. ``notes``: a section's note made from the rows."""
    notes = notes or {}
    out = []
    for section in SECTIONS:
        shown = [d for d in drawn if d.entry.section == section.id and not d.skipped]
        if shown:
            note = Markup(notes.get(section.id) or section.note)
            out.append({"id": section.id, "title": section.title, "note": note, "drawn": shown})
    known = {s.id for s in SECTIONS}
    for d in drawn:  # an entry of a section not listed: a section of its own
        if d.entry.section not in known and not d.skipped:
            out.append({"id": d.entry.name, "title": d.entry.question, "note": "", "drawn": [d]})
    return out
