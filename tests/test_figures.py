"""The report's figures read at a glance: the ways drawn along their factors (at most 8 lines a
panel, a legend per encoding, nn.MultiheadAttention in every panel), compile time as one table,
decode, grouped-head and window figures when the sweep varies their keys, every figure at least
600 px wide in a 1280-px window. A figure that fails is said in the page, and fails the tests
(they draw in strict mode).

The main job's report here is rendered from the rows of a real run of it (sweep=default on an
H100, 152 points, 38 ways: reports/examples/), re-rendered by this code."""

from __future__ import annotations

import base64
import dataclasses
import re
import struct

import pandas as pd
import pytest

from harness.report.ways import load as load_ways
from harness.report import catalogue, figures
from harness.report import render as report
from harness.report.compiled import compile_table
from harness.report.encoding import MAX_LINES, PREFIX, encode, with_factors
from tests.conftest import REPO, TINY

MAIN = REPO / "reports" / "examples" / "nvidia-h100-80gb-hbm3" / "main" / "results.csv"
LINE_FIGURES = ("latency", "speedup_lines", "throughput", "memory")


def width(fig: figures.Figure) -> int:
    """The PNG's width in pixels, from its header."""
    return struct.unpack(">I", base64.b64decode(fig.png)[16:20])[0]


def draw(rows: pd.DataFrame) -> dict[str, catalogue.Drawn]:
    """Every figure of the catalogue drawn from ``rows`` (prepared), by name; a figure that
    fails raises."""
    return {d.entry.name: d for d in catalogue.draw(report.timed_ok(rows), strict=True)}


def figures_of(html: str) -> list[str]:
    """The names of the figures a rendered page shows; it must show no failed one."""
    assert 'class="figure-failed"' not in html, html[html.find('class="figure-failed"') :][:2000]
    return re.findall(r'<img class="plot"[^>]* data-figure="(\w+)"', html)


@pytest.fixture(scope="module")
def main_rows() -> pd.DataFrame:
    return report.prepare(pd.read_csv(MAIN), load_ways(MAIN.parent))  # as its report reads it


@pytest.fixture(scope="module")
def main_figures(main_rows) -> dict:
    return draw(main_rows)


# every figure of the main job's 38 ways drawn (22 s here): make test-slow and CI run it
@pytest.mark.slow
def test_the_main_jobs_38_ways_are_drawn_along_their_factors(main_rows, main_figures):
    assert main_rows["way"].nunique() == 38
    ok = report.timed_ok(main_rows)
    enc = encode(with_factors(ok), "seq_len")
    assert (enc.col, enc.row) == (PREFIX + "attention", PREFIX + "merge")  # a panel per kernel
    assert (enc.hue, enc.style, enc.marker) == (PREFIX + "structure", PREFIX + "compile", None)
    assert enc.split == ["mask"]  # a figure per mask: no mark averages none and causal
    for name in LINE_FIGURES:
        drawn = main_figures[name].figures
        assert drawn and len(drawn) == 2, (name, main_figures[name])
        for fig in drawn:
            # counted on the drawn figure: errorbar lines per panel, entries per legend
            assert 2 < fig.lines <= MAX_LINES, (name, fig.title, fig.lines)
            assert 0 < fig.legend <= 12, (name, fig.title, fig.legend)
            assert width(fig) >= 700 and fig.title.startswith("How ")
    decode = main_figures["decode_latency"]  # the main job does not decode
    assert decode.figures is None and decode.skipped == "no row of its kind"


def test_every_row_is_one_mark_of_one_line(main_rows):
    """Each timed row lands in exactly one panel line (none averaged, none left out)."""
    ok = report.timed_ok(main_rows)
    laid = figures.plan(ok, "seq_len", "latency_ms_median")
    drawn = 0
    for _, group in laid.groups:
        _, panels = figures._panels(group, laid.enc)
        for _, part in panels:
            ours = part[part[PREFIX + "structure"] != "reference"]
            drawn += len(ours)
            lines = ours.groupby(laid.enc.in_panel()).size()
            assert (lines == 2).all()  # one mark per swept seq_len
    assert drawn == (ok["variant"] != "reference").sum()


def test_an_outside_variants_own_options_are_encoded_too():
    """A variant of one's own with options of its own (tile: 5 values, order: 2) beside compile:
    40 ways; still at most 8 lines a panel, its options named in the panels and legends."""
    rows = []
    for tile in (16, 32, 64, 128, 256):
        for order in ("ij", "ji"):
            for mode in ("off", "default"):
                for L in (128, 1024):
                    rows.append(
                        dict(
                            variant="mine",
                            variant_options=f"tile={tile} order={order}",
                            label=f"mine/tile={tile},order={order}",
                            compile=mode,
                            seq_len=L,
                            status="ok",
                            latency_ms_median=L / tile * (1.5 if order == "ji" else 1),
                        )
                    )
    for mode in ("off", "default"):
        for L in (128, 1024):
            rows.append(
                dict(variant="reference", label="reference", compile=mode, seq_len=L)
                | dict(status="ok", latency_ms_median=L / 50)
            )
    df = report.prepare(pd.DataFrame(rows))
    assert df["way"].nunique() == 22
    enc = encode(with_factors(df), "seq_len")
    assert enc.col == PREFIX + "tile" and enc.hue == PREFIX + "order"
    drawn = figures.lines(df, "seq_len", "latency_ms_median", "How?", "ms", "L")
    assert len(drawn) == 1 and 0 < drawn[0].lines <= MAX_LINES and drawn[0].legend <= 12


def test_compile_time_is_one_table_by_structure_and_kernel(main_rows):
    ok = main_rows[main_rows["status"] == "ok"]
    table = compile_table(ok)
    assert table["kernel"] == "attention"
    assert table["columns"] == ["manual", "sdpa", "flex", "nn.MHA"]
    labels = [r["label"] for r in table["rows"]]
    assert (
        "fused · compile=default" in labels and "nn.MultiheadAttention · compile=default" in labels
    )
    assert len(labels) <= 8  # structures x compile modes, not a bar per point (88)
    cells = [c for r in table["rows"] for c in r["cells"] if c]
    assert sum(c["n"] for c in cells) == ok["compile_s"].notna().sum()  # every point counted once
    assert all(c["low"] <= c["median"] <= c["high"] for c in cells)
    assert set(table["over"]) == {"merge", "seq_len", "mask"}
    assert compile_table(ok.assign(compile_s=None)) is None


def decode_rows() -> pd.DataFrame:
    """What sweep=llm's decode and prefill give: fused (manual, sdpa) with a static and a
    concatenating cache, nn.MHA recomputing, at 3 cache lengths x 2 K/V-head counts; prefill at
    3 K/V-head counts, causal and a window."""
    rows = []
    for heads in (8, 2):
        for P in (2048, 8192, 32768):
            for attention in ("manual", "sdpa"):
                for cache in ("static", "concat"):
                    ms = P / 1e4 * (1.3 if cache == "concat" else 1)
                    rows.append(
                        dict(
                            variant="fused",
                            variant_options=f"attention={attention} merge=view",
                            kv_cache=cache,
                            latency_ms_median=ms,
                            gbps=P / ms / 1e3,
                        )
                        | dict(num_kv_heads=heads, kv_cache_len=P, seq_len=1, copy_gbps=9.0)
                    )
            rows.append(
                dict(variant="reference", kv_cache="none", latency_ms_median=P / 1e3, gbps=0.3)
                | dict(num_kv_heads=heads, kv_cache_len=P, seq_len=1, copy_gbps=9.0)
            )
    for structure in ("separate", "fused", "reference"):
        for attention in ("manual", "sdpa"):
            options = "" if structure == "reference" else f"attention={attention} merge=view"
            if structure == "reference" and attention == "sdpa":
                continue
            for heads, mask, window in (
                (8, "causal", None),
                (2, "causal", None),
                (1, "causal", None),
                (2, "sliding", 128),
            ):
                rows.append(
                    dict(variant=structure, variant_options=options, mask=mask, window=window)
                    | dict(num_kv_heads=heads, seq_len=512, latency_ms_median=1 + heads / 8)
                )
    df = pd.DataFrame(rows).assign(status="ok", num_heads=8)
    df["mask"] = df["mask"].fillna("causal")
    df["kv_seq_len"] = df["seq_len"] + df["kv_cache_len"].fillna(0)
    return report.prepare(df)


@pytest.mark.slow  # three families of figures drawn (16 s here): make test-slow and CI run it
def test_decode_grouped_and_window_figures_follow_their_keys():
    drawn = draw(decode_rows())
    for name, x in (
        ("decode_latency", "kv_cache_len"),
        ("decode_gbps", "kv_cache_len"),
        ("grouped", "num_kv_heads"),
        ("window", "attends"),
    ):
        assert drawn[name].figures, (name, drawn[name])
        for fig in drawn[name].figures:
            assert fig.x == x and fig.lines <= MAX_LINES and width(fig) >= 700, (name, fig)
    # decode: a line per way (fused x kernel x cache, nn.MHA recomputing), panels per K/V heads
    assert [f.lines for f in drawn["decode_latency"].figures] == [5]
    assert "copy bandwidth" in drawn["decode_gbps"].figures[0].title
    # prefill along seq_len: one length per configuration, so no line: said, not drawn
    assert drawn["latency"].figures is None and "one seq_len" in drawn["latency"].not_drawn
    html = report.render(decode_rows(), REPO / "tests", [REPO], strict=True)[0]
    for section in ('id="decode"', 'id="grouped"', 'id="window"'):
        assert section in html
    assert {"decode_latency", "decode_gbps", "grouped", "window"} <= set(figures_of(html))


def read_figures(chromium, html) -> list[dict]:
    """Every image of the report as the browser lays it out in a 1280-px window."""
    chromium.set_window_size(1280, 900)
    chromium.get(html.as_uri())
    return chromium.execute_script(
        "return [...document.images].map(i => ({alt: i.alt, shown: i.getBoundingClientRect().width,"
        " loaded: i.complete && i.naturalWidth > 0, legend: i.dataset.legend,"
        " lines: i.dataset.lines, x: i.dataset.x}))"
    )


# the main job's report rendered and opened in Chromium (30 s here): make test-slow and CI run it
@pytest.mark.slow
def test_the_main_jobs_report_reads_in_a_real_browser(chromium, tmp_path):
    """The main job's report (its real rows) at 1280 px: every figure at least 600 px wide, no
    legend over 12 entries, no panel over 8 lines, compile time one small table."""
    root = tmp_path / "main"
    root.mkdir()
    (root / "results.csv").write_bytes(MAIN.read_bytes())
    assert report.main([str(root), "--report-dir", str(tmp_path / "reports")]) == 0
    images = read_figures(chromium, root / "report.html")
    assert len(images) >= 10 and all(i["loaded"] for i in images), images
    assert all(i["shown"] >= 600 for i in images), [(i["alt"], i["shown"]) for i in images]
    lines = [i for i in images if i["legend"] is not None]
    assert len(lines) == 8  # latency, speedup, throughput, memory: a figure per mask
    assert all(int(i["legend"]) <= 12 and int(i["lines"]) <= 8 for i in lines), lines
    rows = chromium.execute_script(
        "return document.querySelectorAll('#compile-table tbody tr').length"
    )
    assert 0 < rows <= 8
    widths = chromium.execute_script(
        "return [document.documentElement.clientWidth, document.documentElement.scrollWidth]"
    )
    assert widths[1] <= widths[0], widths  # the page does not scroll sideways


def test_one_way_beside_nn_mha_is_one_line_and_one_reference():
    rows = [
        dict(variant=v, label=v, variant_options=o, compile="off", seq_len=L)
        | dict(status="ok", latency_ms_median=L / (100 if v == "fused" else 50))
        for v, o in (("fused", "attention=sdpa merge=view"), ("reference", None))
        for L in (128, 512, 2048)
    ]
    df = report.prepare(pd.DataFrame(rows))
    enc = encode(with_factors(df), "seq_len")
    assert enc.in_panel() == [] and enc.panels() == []  # one panel, nothing to tell apart
    (fig,) = figures.lines(df, "seq_len", "latency_ms_median", "How?", "ms", "L")
    assert fig.lines == 2 and fig.legend == 1 and width(fig) >= 700
    with pytest.raises(figures.NotDrawn, match="one seq_len"):
        figures.lines(df[df["seq_len"] == 128], "seq_len", "latency_ms_median", "?", "ms", "L")
    with pytest.raises(figures.NotDrawn, match="no row has gbps"):
        figures.lines(df, "kv_cache_len", "gbps", "?", "GB/s", "P")


# a report rendered twice with a failing figure (18 s here): make test-slow and CI run it
@pytest.mark.slow
def test_a_figure_that_fails_is_said_in_the_page_and_fails_strict(monkeypatch):
    """A broken figure planted in the catalogue: the report still renders, names the figure and
    its error at the top and in its place, and draws the rest; in strict mode it raises."""

    def broken(rows, entry):
        return rows["no such column"]

    planted = catalogue.Entry("broken", "decode", "Is this figure broken?", catalogue.decode)
    planted = dataclasses.replace(planted, draw=broken)
    monkeypatch.setattr(catalogue, "CATALOGUE", [*catalogue.CATALOGUE, planted])
    rows = decode_rows()
    with pytest.raises(catalogue.FigureFailed, match="'broken' failed: KeyError"):
        report.render(rows, REPO / "tests", [REPO], strict=True)
    html = report.render(rows, REPO / "tests", [REPO])[0]
    assert 'id="figures-failed"' in html and "Is this figure broken?: <code>KeyError" in html
    assert '<p class="figure-failed" data-figure="broken">' in html
    with pytest.raises(AssertionError):
        figures_of(html)  # the tests' helper refuses a page with a failed figure
    shown = re.findall(r'<img class="plot"[^>]* data-figure="(\w+)"', html)
    assert {"decode_latency", "decode_gbps", "grouped", "window"} <= set(shown)


@pytest.mark.slow  # a decode sweep timed (19 s here): make test-slow and CI run it
def test_a_decode_sweeps_report_draws_its_decode_figures_and_heatmap(harness_cli, tmp_path):
    """A small decode sweep (two structures x two kernels x two caches, two cache lengths):
    its report has the decode latency and GB/s figures and the speedup heatmap, and none fails."""
    keys = [k for k in TINY if k.split("=")[0] not in ("seq_len", "batch", "embed_dim")]
    proc = harness_cli(
        "-m",
        "variant=fused,separate",
        "variant.attention=manual,sdpa",
        "kv_cache_len=16,64",
        "seq_len=1",
        "num_kv_heads=1",
        "kv_cache=static,concat",
        "batch=2",
        "embed_dim=32",
        *keys,
        "hydra.sweep.dir=decode",
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    root = tmp_path / "decode"
    shown = figures_of((root / "report.html").read_text())  # the sweep's own report
    assert {"decode_latency", "decode_gbps", "speedup_heatmap"} <= set(shown), shown
    again = report.render_dir(root, tmp_path / "again", strict=True)
    assert set(figures_of(again.read_text())) == set(shown)
