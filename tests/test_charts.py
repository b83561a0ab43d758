"""The report's charts read as a user needs them (issue 57, item 4): ways ranked per shape with
their intervals and named by the way alone; the heatmap fastest first and labelled in x; the
forest plot clipped, with the clipped intervals marked, and ticks that do not overlap."""

import math

import pandas as pd
import pytest

from harness.report import catalogue, charts
from harness.report.analysis import prepare
from harness.report.render import short_label
from harness.sweep.callbacks import ranking_said


@pytest.fixture
def figures(monkeypatch):
    """The matplotlib figures the charts draw, kept instead of rendered to PNG."""
    drawn = []
    monkeypatch.setattr(charts, "png", lambda fig: drawn.append(fig) or "png")
    return drawn


def _row(variant, seq_len, speedup, options="", target=None):
    return dict(
        variant=variant, label=variant + (f"/{options}" if options else ""),
        variant_options=options.replace(",", " "), variant_target=target or f"variants.{variant}.X",
        status="ok", batch=2, seq_len=seq_len, embed_dim=32, num_heads=4, num_kv_heads=4,
        dtype="float32", device="cpu", mask="none", compile="off", n_samples=5,
        latency_ms_median=1 / speedup, latency_ms_ci_low=0.95 / speedup,
        latency_ms_ci_high=1.05 / speedup, speedup=speedup, speedup_ci_low=speedup * 0.95,
        speedup_ci_high=speedup * 1.05,
    )  # fmt: skip


ROWS = [
    _row("fused", 64, 1.3, "attention=sdpa,merge=view"),
    _row("fused", 64, 0.8, "attention=manual,merge=view"),
    _row("reference", 64, 1.0),
    _row("mine", 64, 1.1, target="mine.MyAttention"),
    _row("fused", 128, 2.0, "attention=sdpa,merge=view"),
    _row("fused", 128, 0.7, "attention=manual,merge=view"),
    _row("reference", 128, 1.0),
    _row("mine", 128, 1.2, target="mine.MyAttention"),
]


def test_the_ranked_chart_sorts_each_shapes_ways_and_names_them_by_the_way_alone(figures):
    timed = prepare(pd.DataFrame(ROWS))
    assert charts.ranked(timed) == "png"
    (fig,) = figures
    panels = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title(loc="left") for ax in panels] == list(timed["shape"].drop_duplicates())
    labels = [t.get_text() for t in panels[1].get_yticklabels()]
    assert labels == [
        "fused/attention=sdpa,merge=view",
        "mine",
        "nn.MultiheadAttention",
        "fused/attention=manual,merge=view",
    ], labels  # fastest first; no shape field (4, none, float32) in a way's name
    mine = next(t for t in panels[1].get_yticklabels() if t.get_text() == "mine")
    assert mine.get_color() == charts.YOURS  # your module stands out


def test_the_heatmap_is_fastest_first_and_its_colours_read_in_x(figures):
    speedups, low, high, _ = catalogue.speedups(prepare(pd.DataFrame(ROWS)))
    assert list(charts.fastest_first(speedups).index)[:2] == [
        "fused/attention=sdpa,merge=view",
        "mine",
    ]
    charts.speedup_heatmap(speedups, low, high)
    (fig,) = figures
    rows = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert rows[0] == "fused/attention=sdpa,merge=view" and rows[-1].endswith("manual,merge=view")
    bar = [t.get_text() for t in fig.axes[1].get_yticklabels() if t.get_text()]
    assert "1x" in bar and all(t.endswith("x") for t in bar), bar


def test_a_single_way_or_a_single_shape_draws_no_heatmap_and_ranks_nothing():
    one_way = prepare(pd.DataFrame([r for r in ROWS if r["variant"] == "reference"]))
    heat = next(e for e in catalogue.CATALOGUE if e.name == "speedup_heatmap")
    rank = next(e for e in catalogue.CATALOGUE if e.name == "ranked")
    assert heat.applies(one_way) == "one way in the sweep"
    assert rank.applies(one_way) == "one way per shape"
    one_shape = prepare(pd.DataFrame([r for r in ROWS if r["seq_len"] == 64]))
    assert heat.applies(one_shape).startswith("one shape") and rank.applies(one_shape) == ""
    ranked = pd.DataFrame([{"n_ways": 1, "winner": "reference", "busy": 0}])
    assert ranking_said(ranked) == "one way per shape: nothing to rank"
    ranked = pd.DataFrame([{"n_ways": 3, "winner": "a", "busy": 0}])
    assert ranking_said(ranked) == "1 shape with a winner, 0 ties"


def _summary(ratios):
    return pd.DataFrame(
        [
            dict(by="all", factor="f", baseline=f"b{i}", alternative=f"a{i}", ratio=r,
                 ratio_ci_low=lo, ratio_ci_high=hi, verdict="tie", value="")
            for i, (r, lo, hi) in enumerate(ratios)
        ]
    )  # fmt: skip


def test_one_huge_interval_is_clipped_and_marked_not_squashing_the_rest(figures):
    charts.forest(_summary([(1.1, 1.05, 1.15), (0.9, 0.85, 0.95), (1.0, 0.001, 900.0)]))
    (fig,) = figures
    ax = fig.axes[0]
    low, high = ax.get_xlim()
    assert 0.4 <= low and high <= 2.5, (low, high)  # the centres and 1x, within CLIP of them
    arrows = [ln for ln in ax.lines if ln.get_marker() in ("<", ">")]
    assert {ln.get_marker() for ln in arrows} == {"<", ">"}  # the huge one, cut at both edges
    assert "1 cut at the edge" in ax.get_xlabel()
    ticks = [t for t in ax.get_xticks() if low <= t <= high]
    gaps = [math.log10(b / a) for a, b in zip(ticks, ticks[1:])]
    assert 1.0 in ticks and min(gaps) >= math.log10(high / low) / 8 - 1e-9, ticks


def test_nice_ticks_never_crowd_and_always_hold_one():
    for low, high in [(0.9, 1.1), (0.5, 2), (0.01, 100), (0.95, 3.8), (0.2, 1.02)]:
        ticks = charts.nice_ticks(low, high)
        assert 1 in ticks and all(low <= t <= high for t in ticks), (low, high, ticks)
        span = math.log10(high / low)
        assert all(math.log10(b / a) >= span / 8 - 1e-9 for a, b in zip(ticks, ticks[1:]))


def test_a_short_label_is_the_way_alone():
    row = {**ROWS[0], "num_kv_heads": 4, "mask": "none", "variant": "packed"}
    assert short_label(row) == "packed sdpa view"


def test_a_figure_timed_on_a_busy_machine_is_marked_where_it_could_be_read_as_a_result(figures):
    """Issue 72: a contended row is hollow and named busy in the ranked chart, said in its heatmap
    cell and in each figure's caption; a figure without one carries no note."""
    from harness.report import figures as lines_figures

    rows = [dict(r, contended=(r["variant"] == "mine" and r["seq_len"] == 128)) for r in ROWS]
    timed = prepare(pd.DataFrame(rows))
    charts.ranked(timed)
    fig = figures.pop()
    assert "[1 hollow: timed on a busy machine" in fig._suptitle.get_text()
    labels = [t.get_text() for ax in fig.axes for t in ax.get_yticklabels()]
    assert "mine (busy)" in labels and labels.count("mine") == 1, labels
    speedups, low, high, busy = catalogue.speedups(timed)
    assert int(busy.to_numpy().sum()) == 1 and busy.loc["mine"].iloc[-1]
    charts.speedup_heatmap(speedups, low, high, busy)
    fig = figures.pop()
    cells = [t.get_text() for t in fig.axes[0].texts]
    assert sum(c.endswith("\nbusy") for c in cells) == 1, cells
    assert "[1 cell busy" in fig.axes[0].get_title(loc="left")
    drawn = lines_figures.lines(timed, "seq_len", "speedup", "How fast?", "speedup", "L")
    assert all("hollow: timed on a busy machine" in f.title for f in drawn), drawn
    quiet = lines_figures.lines(prepare(pd.DataFrame(ROWS)), "seq_len", "speedup", "Q", "s", "L")
    assert not any("busy" in f.title for f in quiet)
