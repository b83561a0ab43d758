"""Issue 74, what a new user saw in the reports (a fresh clone, a 1280-px wide Chromium): the
ways chart's title clear of its first panel, nn.MultiheadAttention named so in every table and
figure, a correctness table that fits the window, a way that could not run shown without an
error location and with its reason whole, the passing ways in one line, no fastest-way table
where no shape has two ways, no race finding outside a race, assert_matches' message in round
figures that reads as the failure it is, and the README saying to make a venv first.

The report of the main job is modelled by rows like its own (``_main_job``: 38 ways at 4 shapes,
the 8 points of separate FlexAttention under torch.compile unsupported, and a module of yours
that fails), rendered check-only: no figure to draw, the same tables.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pandas as pd
import pytest

from harness.progress import first_line, result_line
from harness.report import analysis, catalogue, charts, verdicts
from harness.report.render import render_dir, short_label
from tests.conftest import REPO, TINY, harness_env

SHAPES = [dict(seq_len=L, mask=m) for L in (8, 16) for m in ("none", "causal")]
BASE = dict(batch=1, embed_dim=16, num_heads=2, num_kv_heads=2, dtype="float32", device="cpu")
# the row's error as the main job writes it (harness/errors.py, EXPLAINED; cut at 500 there)
UNSUPPORTED = (
    "torch.compile (inductor) could not lower FlexAttention inside this compiled module: a "
    "limitation of the installed torch for these inputs' layout, not a wrong result "
    "[InductorError: LoweringException: ValueError: not enough values to unpack (expected 4, "
    "got 2) target: flex_attention args[0]: TensorBox( ReinterpretView( StorageBox( "
    "ExternKernelOut( python_kernel_name='extern_kernels.addmm', name=buf0, layout="
    "FixedLayout('cpu', torch.float32, size=[8, 48], stride=[48, 1]), inputs=[InputBuffer(name="
)
PASSED = dict(
    status="ok", check_passed=True, worst_tensor="out", max_abs_err=4.99e-07, tolerance=2.1e-05,
    err_ratio=1.42, ref_err=3.5e-07, worst_index="(0, 1, 12)",
)  # fmt: skip
SAYS = "it computes nn.MHA with the heads merged without the permute ((B, H, L, D) reshaped"
FAILED = dict(
    status="mismatch", check_passed=False, worst_tensor="grad_in_proj_weight",
    failed_tensors="out;grad_query;grad_key;grad_value;grad_in_proj_weight", max_abs_err=18.9,
    tolerance=0.000143, err_ratio=2.05e6, ref_err=7e-05, worst_index="(369, 213)",
    diagnosis="heads_merged_without_permute", diagnosis_says=SAYS + " straight to (B, L, E))",
    diagnosis_fix="o.transpose(1, 2).reshape(B, L, E): move H back next to D first",
    wrong_where="Where: the output differs in all 2 heads, all 8 query rows, all 1 batch elements.",
    error="grad_in_proj_weight: max_abs_err=18.9 > tolerance=0.000143. Diagnosis: " + SAYS,
)  # fmt: skip


def _way(structure: str, options: str = "", compile_: str = "off", **kw) -> dict:
    return dict(
        **BASE, variant=structure, label=structure + (f"/{options}" if options else ""),
        variant_options=options.replace(",", " "), compile=compile_,
        variant_target=kw.pop("target", f"variants.{structure}.X"), **kw,
    )  # fmt: skip


def _main_job() -> pd.DataFrame:
    rows = []
    cannot = dict(status="unsupported", error=UNSUPPORTED)
    for shape in SHAPES:
        for s in ("separate", "fused", "packed"):
            for a in ("manual", "sdpa", "flex"):
                for m in ("view", "reshape"):
                    for c in ("off", "default"):
                        said = cannot if (s, a, c) == ("separate", "flex", "default") else PASSED
                        rows.append(_way(s, f"attention={a},merge={m}", c, **shape, **said))
        rows += [_way("reference", "", c, **shape, **PASSED) for c in ("off", "default")]
        rows.append(_way("mine", "", target="mine.MyAttention", **shape, **FAILED))
    return pd.DataFrame(rows)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    root = tmp_path_factory.mktemp("main_job")
    _main_job().to_csv(root / "results.csv", index=False)
    render_dir(root, root / "reports")
    return root / "report.html"


def _open(chromium, html):
    chromium.set_window_size(1280, 900)
    chromium.get(html.as_uri())


def test_the_correctness_table_fits_a_1280_px_window(chromium, report):
    """It was 1772 px wide in the main job's report (way and shape never wrapped)."""
    _open(chromium, report)
    got = chromium.execute_script(
        "const t = document.getElementById('correctness');"
        "return {width: document.documentElement.clientWidth, table: t.scrollWidth,"
        " right: t.getBoundingClientRect().right, box: t.parentElement.scrollWidth,"
        " page: document.documentElement.scrollWidth,"
        " fails: [...t.querySelectorAll('tbody tr')].filter(r => r.cells[0].innerText == 'FAIL')"
        ".length}"
    )
    assert got["fails"] == 4, got  # the failing rows are there, with their diagnosis
    said = chromium.execute_script(
        "return document.getElementById('correctness').querySelector('tr.fail + tr').innerText"
    )
    assert SAYS in said and "the output differs in all 2 heads" in said, said
    assert got["table"] <= got["width"] and got["right"] <= got["width"], got
    assert got["box"] <= got["width"] and got["page"] <= got["width"], got


def test_a_way_that_could_not_run_has_no_error_location_and_its_reason_whole(chromium, report):
    """`unsupported` rows said "where the error is: at B=1 ... and 3 more" and cut the reason
    mid-word ("not a wrong r…")."""
    _open(chromium, report)
    rows = chromium.execute_script(
        "return [...document.querySelectorAll('#verdict-table tbody tr')].map(tr =>"
        " [...tr.cells].map(c => c.innerText))"
    )
    titles = chromium.execute_script(
        "return [...document.querySelectorAll('#verdict-table tbody tr')].map(tr =>"
        " (tr.cells[3].querySelector('[title]') || {}).title || '')"
    )
    limits = [(r, t) for r, t in zip(rows, titles) if r[1] == "unsupported"]
    assert len(limits) == 2, rows  # separate flex +compile, view and reshape
    for (way, _, points, reason, fix, where), title in limits:
        assert points == "4 of 4" and fix == "" and where == "", (way, where)
        assert reason.startswith("torch.compile (inductor) could not lower FlexAttention")
        assert "not a wrong result" in reason, reason  # the explanation whole
        assert title == first_line(UNSUPPORTED, len(UNSUPPORTED)), title  # and all of it
    mine = next(r for r in rows if r[0] == "mine")
    assert mine[1] == "mismatch" and mine[5].startswith("the output differs in all 2 heads")


def test_the_ways_that_pass_are_one_line_naming_them_on_demand(chromium, report):
    """The verdict's "36 ways pass" was a paragraph of their names, 8 lines at 1280 px."""
    _open(chromium, report)
    got = chromium.execute_script(
        "const d = document.querySelector('details.passed-ways');"
        "const s = d.querySelector('summary');"
        "return {height: s.getBoundingClientRect().height, summary: s.innerText,"
        " line: parseFloat(getComputedStyle(s).lineHeight), open: d.open, names: d.textContent}"
    )
    assert got["summary"].startswith("36 ways pass at every point they ran"), got
    assert got["height"] <= 1.5 * got["line"] and not got["open"], got  # one line, closed
    assert "nn.MultiheadAttention +compile=default" in got["names"], got["names"]
    assert "reference" not in got["names"], got["names"]


def test_the_console_and_the_progress_line_cut_a_reason_at_a_word():
    """They cut it mid-word: "..., not a wrong r… (the whole text: errors.log)"."""
    cut = first_line(UNSUPPORTED)
    assert len(cut) <= 160 and cut.endswith("…") and UNSUPPORTED[len(cut) - 1] == " ", cut
    assert first_line("a [b] " + "word " * 40 + "[raw text]" * 20).endswith("word…")
    assert first_line("x" * 400).startswith("x" * 150)  # one token: cut inside it
    point = result_line({**_way("separate", "attention=flex,merge=view", "default"),
                         **SHAPES[0], "status": "unsupported", "error": UNSUPPORTED})  # fmt: skip
    assert f"-- {cut} (the whole text: errors.log)" in point, point


def _timed(ways: list[str], speedups=(1.3, 0.9, 1.1)) -> pd.DataFrame:
    """Timed rows: each of ``ways`` (a structure, or structure/options) at 2 shapes."""
    rows = []
    for L in (8, 16):
        for i, w in enumerate(ways):
            structure, _, options = w.partition("/")
            x = speedups[i % len(speedups)] * (1 + i / 100)
            rows.append(_way(structure, options, seq_len=L, mask="none", **PASSED, n_samples=3,
                             latency_ms_median=1 / x, latency_ms_ci_low=0.95 / x,
                             latency_ms_ci_high=1.05 / x, speedup=x, speedup_ci_low=x * 0.95,
                             speedup_ci_high=x * 1.05))  # fmt: skip
    return pd.DataFrame(rows)


def test_a_one_way_per_shape_sweep_has_no_fastest_way_table(tmp_path):
    """Each shape's "fastest" was its only way: a table of tautologies (the console already said
    "one way per shape: nothing to rank"). Two ways or more: tests/test_report.py's table."""
    _timed(["fused"]).to_csv(tmp_path / "results.csv", index=False)
    html = render_dir(tmp_path, tmp_path / "reports").read_text()
    assert 'id="best"' not in html and "Fastest correct way" not in html
    assert 'href="#best"' not in html  # no finding links to a table not drawn
    assert 'id="effects"' in html  # the sections after it are drawn


def test_nn_mha_is_named_so_in_the_heatmap_the_tables_and_the_verdict(monkeypatch):
    """The heatmap's rows said "reference" where the findings, the line figures and the ranked
    chart say nn.MultiheadAttention."""
    drawn = []
    monkeypatch.setattr(charts, "png", lambda fig: drawn.append(fig) or "png")
    timed = analysis.prepare(_timed(["fused/attention=sdpa", "reference", "packed"]))
    charts.speedup_heatmap(*catalogue.speedups(timed))
    labels = [t.get_text() for t in drawn[0].axes[0].get_yticklabels()]
    assert "nn.MultiheadAttention" in labels and "reference" not in labels, labels
    assert short_label(_way("reference", "", "default")) == "nn.MultiheadAttention +compile"
    names = verdicts.report_rows(_main_job())["rows"][-1]["names"]
    assert "nn.MultiheadAttention, nn.MultiheadAttention +compile=default" in names, names


def test_the_ways_charts_title_clears_its_first_panels_title(monkeypatch):
    """With the main job's 38 ways a panel is tall, and tight_layout left the figure's title
    too little room: it overlapped the first panel's shape."""
    drawn = []
    monkeypatch.setattr(charts, "png", lambda fig: drawn.append(fig) or "png")
    ways = [f"fused/attention=sdpa,merge=view,n={i}" for i in range(36)] + ["reference"]
    rows = pd.concat([_timed(ways).assign(seq_len=L) for L in (8, 16)])
    rows["mask"] = ["none", "causal"] * (len(rows) // 2)  # 4 shapes: two rows of two panels
    charts.ranked(analysis.prepare(rows))
    (fig,) = drawn
    renderer = fig.canvas.get_renderer()
    title = fig._suptitle.get_window_extent(renderer)
    panels = [ax for ax in fig.axes if ax.get_visible()]
    assert len(panels) == 4
    tops = [ax.title if ax.get_title() else ax._left_title for ax in panels]
    highest = max(t.get_window_extent(renderer).y1 for t in tops)
    assert title.y0 >= highest, (title, highest)  # above every panel's title, none overlapping


def _raced_rows() -> pd.DataFrame:
    return _timed(["fused/attention=sdpa", "reference", "mine"]).assign(
        variant_target=lambda d: d["variant"].map(
            lambda v: "mine.MyAttention" if v == "mine" else f"variants.{v}.X"
        )
    )


@pytest.mark.parametrize(
    "preset, raced", [("race", True), ("default", False), (None, False), ("no record", True)]
)
def test_a_race_finding_only_in_a_race(tmp_path, preset, raced):
    """A module of yours in a plain ``run -m`` got "finding: race:" lines; Hydra's record of the
    sweep says whether it was a race (rows with no record say what they always did)."""
    if preset != "no record":
        choices = {"sweep": preset} if preset else {"variant": "mine"}
        (tmp_path / "multirun.yaml").write_text(
            "hydra:\n  runtime:\n    choices:\n"
            + "".join(f"      {k}: {v}\n" for k, v in choices.items())
        )
    said = analysis.analyze(_raced_rows(), tmp_path).findings
    assert any(f["factor"] == "race" for f in said) == raced, said


def test_a_plain_sweep_with_a_module_of_yours_prints_no_race_finding(tmp_path):
    paced = REPO / "tests" / "paced"
    proc = subprocess.run(
        [sys.executable, "-m", "harness", "--config-dir", str(paced / "conf"), "-m",
         "variant=five_ms,fused", *TINY, "hydra.sweep.dir=sweep"],
        cwd=tmp_path, env=harness_env(paced), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    findings = [ln for ln in proc.stdout.splitlines() if ln.startswith("finding: ")]
    assert findings and not [ln for ln in findings if ln.startswith("finding: race:")], findings


def test_assert_matches_quotes_round_figures_and_reads_as_a_failure():
    """It quoted max_abs_err=2.1069628139962595, and "(within 1.1x nn.MHA's own error; fix: ...)"
    read like a pass: that figure is the module's distance from the mistake it computes."""
    import harness
    from tests.test_api import SMALL, SwappedKV

    with pytest.raises(AssertionError) as e:
        harness.assert_matches(SwappedKV, **SMALL, cross=True, kv_seq_len=5)
    said = str(e.value)
    assert said.startswith("mismatch: out: max_abs_err=")
    shown = said.rsplit(" (check_passed=", 1)[1]
    assert not re.search(r"\d\.\d{4,}", shown), shown  # 3 significant digits
    assert "max_abs_err=2.1," in shown or re.search(r"max_abs_err=\d\.\d\d,", shown), shown
    assert "(its distance from that mistake: " in said and "(within " not in said, said


def test_the_readme_says_to_make_a_venv_before_the_set_up():
    readme = (REPO / "README.md").read_text()
    setup = readme.split("## Set-up", 1)[1].split("```", 1)[0]  # before its two commands
    assert "venv first" in setup and "python3 -m venv" in setup, setup
