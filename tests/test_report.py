"""The report in a real headless Chromium, re-rendering, degenerate sweeps, and A/B compare."""

import subprocess
import sys
from pathlib import Path

import pandas as pd

from harness.report.busy import contended
import pytest

from harness.report import compare
from harness.report import render as report
from harness.results import timed_ok
from tests import browser
from tests.conftest import PLAIN, TINY, run_harness

SWEEP = [  # 16 points (a second dtype: the main job's report, tests/test_figures.py, slow)
    "-m",
    PLAIN,
    "seq_len=8,16",
    "mask=none,causal",
    *[a for a in TINY if not a.startswith("seq_len")],
]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """One sweep for the tests that read its report (25 s on 2 cores): they only read it or
    render it again from its files."""
    base = tmp_path_factory.mktemp("report")
    proc = run_harness(*SWEEP, "hydra.sweep.dir=sweep", cwd=base)
    assert proc.returncode == 0, proc.stderr
    (base / "sweep" / "stdout.txt").write_text(proc.stdout)
    return base / "sweep"


def test_report_in_a_real_browser(chromium, sweep, tmp_path):
    df = pd.read_csv(sweep / "results.csv")
    html = sweep / "report.html"
    chromium.get(html.as_uri())
    chromium.get_log("browser")  # drain anything from before this page
    chromium.refresh()
    images = chromium.execute_script(
        "return [...document.images].map(i => [i.alt, i.complete && i.naturalWidth > 0])"
    )
    assert len(images) >= 4, images  # latency, speedup, throughput, memory at least
    assert all(ok for _, ok in images), [alt for alt, ok in images if not ok]
    errors = [e for e in chromium.get_log("browser") if e["level"] in ("SEVERE", "ERROR")]
    assert errors == []
    rows = chromium.execute_script("return document.querySelectorAll('#results tbody tr').length")
    assert rows == len(df)
    best = chromium.execute_script("return document.querySelectorAll('#best tbody tr').length")
    assert best == df.drop_duplicates(["seq_len", "dtype", "mask"]).shape[0]
    # nothing from the network: every image, script and stylesheet is inlined (a data: URI;
    # "http" can occur by chance inside a PNG's base64)
    sources = chromium.execute_script(
        "return [...document.querySelectorAll('img,script,link')].map(e => e.src || e.href || '')"
    )
    assert all(u.startswith("data:") for u in sources), [u[:80] for u in sources]
    out = tmp_path / "report.png"
    browser.screenshot(chromium, out)
    assert out.stat().st_size > 10_000

    # Answers first: findings open the report, the effects' forest plot is drawn, and the compact
    # table of the fastest way per shape fits a 1280-px window (no page-wide scrolling).
    findings = chromium.execute_script(
        "return [...document.querySelectorAll('#findings li')].map(li => li.textContent)"
    )
    printed = [
        ln for ln in (sweep / "stdout.txt").read_text().splitlines() if ln.startswith("finding: ")
    ]
    assert any(f.startswith("structure:") for f in findings), findings
    assert len(findings) == len(printed) >= 2  # the CLI ends with the same sentences
    forest = chromium.execute_script(
        "const i = document.querySelector('#forest'); return i && i.complete && i.naturalWidth"
    )
    assert forest and forest > 300
    chromium.set_window_size(1280, 900)
    widths = chromium.execute_script(
        "return [document.documentElement.clientWidth, document.documentElement.scrollWidth,"
        " document.querySelector('#best').getBoundingClientRect().right]"
    )
    assert widths[2] <= widths[0] and widths[1] <= widths[0], widths
    effects_csv = pd.read_csv(sweep / "effects.csv")
    assert set(effects_csv["factor"]) == {"structure"}  # the sweep's ways differ in structure only
    # separate/fused/packed pairwise at every shape, of the ways timed by the shape's clock: under
    # load the CPU clock steps aside for a call that a steal burst held off the CPU, and that row,
    # timed by the wall clock, pairs with none (harness/results.py, ``other_method``)
    ways = timed_ok(df).query("variant != 'reference'").groupby(["seq_len", "dtype", "mask"]).size()
    assert len(effects_csv) == sum(n * (n - 1) // 2 for n in ways) > 0


@pytest.mark.slow  # the report rendered twice more (23 s here): make test-slow and CI run it
def test_report_rerenders_from_files_alone(sweep, tmp_path):
    (sweep / "report.html").unlink()
    assert report.main([str(sweep), "--report-dir", str(tmp_path / "again")]) == 0
    assert (sweep / "report.html").exists() and list((tmp_path / "again").glob("*.html"))
    # As typed: the console script the set-up installs beside this Python, and the older form.
    script = Path(sys.executable).parent / "mha-bench"
    assert script.exists(), "no mha-bench console script: run bash scripts/setup.sh"
    (sweep / "report.html").unlink()
    proc = subprocess.run(
        [str(script), "report", str(sweep), "--report-dir", str(tmp_path / "cli")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert (sweep / "report.html").exists() and proc.stdout.startswith("report: ")
    # the older form is the same main (a render each is 5 s of the suite): it answers
    older = [sys.executable, "-m", "harness.report", "--help"]
    proc = subprocess.run(older, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.startswith("usage: mha-bench report"), proc.stderr


# a sweep and three renders (17 s here): make test-slow and CI run it
@pytest.mark.slow
def test_a_damaged_ways_file_is_one_warning_and_the_ways_are_named_by_their_values(
    sweep, tmp_path, capsys
):
    """The sweep's end writes ways.json (titles from the registries); damaged, the report says
    so in one line and names the ways by their values, exit 0."""
    import json
    import shutil

    ways = json.loads((sweep / "ways.json").read_text())
    assert ways["titles"]["attention"]["sdpa"] == "F.scaled_dot_product_attention"
    copy = tmp_path / "copy"
    shutil.copytree(sweep, copy)
    (copy / "ways.json").write_text("{not json")
    assert report.main([str(copy), "--report-dir", str(tmp_path / "again")]) == 0
    err = capsys.readouterr().err
    assert err.count("ways.json: not JSON") == 1 and "row left out" not in err, err
    assert "Traceback" not in err
    # a kernel without its order passed the file check and ended `report` in KeyError (issue 74)
    for kernel in ways["kernels"].values():
        kernel.pop("order", None)
    (copy / "ways.json").write_text(json.dumps(ways))
    assert report.main([str(copy), "--report-dir", str(tmp_path / "again")]) == 0
    err = capsys.readouterr().err
    assert "order must be an integer (it has none)" in err and "Traceback" not in err, err


def test_report_of_everything_failed_still_renders(harness_cli, tmp_path):
    proc = harness_cli("-m", "dtype=float64,int8", *TINY, "hydra.sweep.dir=bad")
    assert proc.returncode == 0, proc.stderr
    text = (tmp_path / "bad" / "report.html").read_text()
    assert "Nothing was timed" in text and text.count('class="other"') >= 2


SLOWDOWN = """
# Loaded at interpreter start-up (sitecustomize) in run B only: the fused variant's forward
# gets 200 ms slower (~100x at this shape), as if someone had broken it: far enough outside
# any interval a loaded machine gives (with 20 ms, a busy CI machine's rounds gave 6.4x
# [0.64, 65]: "same"). Everything else is the same code.
import time
import variants.fused as fused

_forward = fused.FusedQKVMHA.forward


def slowed(self, *args, **kwargs):
    time.sleep(0.2)
    return _forward(self, *args, **kwargs)


fused.FusedQKVMHA.forward = slowed
"""


@pytest.mark.slow  # three sweeps, one slowed (39 s here): make test-slow and CI run it
def test_compare_passes_same_code_and_flags_a_slowed_point(harness_cli, tmp_path, capsys):
    """Three sweeps, the last slowed by 200 ms a call (about 20 s: three processes, and the slow
    run's calls)."""
    points = [
        "-m",
        "variant=fused,reference",
        "seq_len=128",
        "batch=2",
        "embed_dim=256",
        "num_heads=4",
        "timing.rounds=5",
        "num_threads=1",  # two threads stall each other on a busy machine (tests/conftest.py)
    ]
    slow = tmp_path / "slowdown"
    slow.mkdir()
    (slow / "sitecustomize.py").write_text(SLOWDOWN)
    for name, paths in (("a", ()), ("b", ()), ("slow", [slow])):
        proc = harness_cli(*points, f"hydra.sweep.dir={name}", paths=paths)
        assert proc.returncode == 0, proc.stderr
    # Same code, back to back. The false-alarm rate at the default threshold is measured by
    # `make stability` (docs/measurements.md), not here: a unit test asserts no timing, so the gate
    # is wide and the test checks matching, the compare.csv beside the report, and verdicts.
    same = compare.main(
        [
            str(tmp_path / "a"),
            str(tmp_path / "b"),
            "--threshold",
            "0.5",
            "--out",
            str(tmp_path / "ab.html"),
        ]
    )
    out = capsys.readouterr().out
    assert "of 2 matched points" in out and "0 unmatched" in out
    # A busy machine (the suite's other worker) may spoil a run's rounds: then "not comparable"
    # (exit 3) is the right answer, never a regression.
    busy = {
        name: bool(contended(pd.read_csv(tmp_path / name / "results.csv")).any())
        for name in ("a", "b", "slow")
    }
    verdicts = set(pd.read_csv(tmp_path / "ab.csv")["verdict"])
    assert "regression" not in verdicts, out
    # an interval wider than the gate (a loaded machine's): "cannot tell", exit 3, never "same"
    untold = any(str(v).startswith("cannot tell") for v in verdicts)
    if busy["a"] or busy["b"]:
        assert same == 3 and out.startswith("not comparable: the machine was busy"), out
    elif untold:
        assert same == 3, out
    else:
        assert same == 0, out
        assert verdicts <= {"same", "faster", "slower", "reference"}
    # The same points with the fused variant deliberately slowed, at the default 5%.
    slowed = compare.main(
        [str(tmp_path / "a"), str(tmp_path / "slow"), "--out", str(tmp_path / "slow.html")]
    )
    out = capsys.readouterr().out
    fused = [line for line in out.splitlines() if "fused/attention=sdpa,merge=view" in line]
    assert len(fused) == 1, out
    if busy["a"] or busy["slow"]:  # a regression is only ever said of clean rounds
        assert slowed in (1, 3) and fused[0].startswith(("regression", "not comparable")), out
    else:
        assert slowed == 1 and fused[0].startswith("regression"), out
        assert "regression" in (tmp_path / "slow.html").read_text()


def test_compare_lists_unmatched_points(tmp_path, capsys):
    a = tmp_path / "a.csv"
    b = tmp_path / "b.csv"
    row = dict(variant="fused", status="ok", latency_ms_median=1.0, latency_ms_iqr=0.01, seq_len=8)
    pd.DataFrame([row, {**row, "seq_len": 16}]).to_csv(a, index=False)
    pd.DataFrame([{**row, "latency_ms_median": 1.001}]).to_csv(b, index=False)
    assert compare.main([str(a), str(b), "--out", str(tmp_path / "c.html")]) == 0
    out = capsys.readouterr().out
    assert "same" in out and "1 unmatched" in out
    assert compare.main([str(a), str(tmp_path / "missing")]) == 2


def test_the_report_says_which_cuda_points_are_launch_bound():
    """In the rule's own words, its ratio read from the schema: eager call time against device
    time. Rows from before the eager columns were flagged by another rule: the note says so."""
    import pandas as pd

    from harness import schema
    from harness.report.render import launch_bound_note

    df = pd.DataFrame(
        {
            "launch_bound": [True, False, None],
            "status": ["ok"] * 3,
            "timed_by": ["graph", "graph", "events"],
            "eager_ms_median": [0.2, 0.5, 0.3],
            "latency_ms_median": [0.05, 0.45, 0.3],
        }
    )
    note = launch_bound_note(df)
    assert note.startswith("1 of 2 timed CUDA points are launch-bound"), note
    assert f"(eager call time at least {schema.LAUNCH_BOUND:g}x device time)" in note
    assert "launch_ms_per_call" not in note and "0.8x" not in note
    assert launch_bound_note(df.assign(launch_bound=[False, False, None])) == ""
    assert launch_bound_note(pd.DataFrame({"status": ["ok"]})) == ""  # a CPU sweep: no column
    older = df.drop(columns=["eager_ms_median", "timed_by"])
    assert "by the older rule" in launch_bound_note(older)


def test_figures_tick_the_swept_lengths_and_title_panels_with_plain_values(monkeypatch):
    """The x axis says 128 and 1024 (not matplotlib's overlapping 2x10^2, 3x10^2 ...), the y axis
    0.1 and 1 (not 1e-01), and a panel of a float column says kv_cache_len=2048, never 2048.0
    or window=nan."""
    from harness.report import figures

    drawn = []

    def keep(fig):
        fig.canvas.draw()  # tick labels are made when drawn
        ticks = [[t.get_text() for t in ax.get_xticklabels()] for ax in fig.axes]
        ys = [t.get_text() for ax in fig.axes for t in ax.get_yticklabels(minor=True)]
        ys += [t.get_text() for ax in fig.axes for t in ax.get_yticklabels()]
        assert not [y for y in ys if "e" in y or "times" in y], ys  # 0.1, not 1e-01 or 10^-1
        drawn.append(([ax.get_title() for ax in fig.axes], [labels for labels in ticks if labels]))
        figures.plt.close(fig)
        return ""

    monkeypatch.setattr(figures, "png", keep)
    rows = [
        dict(
            way=way,
            variant=way,
            seq_len=L,
            kv_cache_len=P,
            window=float("nan"),
            mask="causal",
            dtype="float32",
            num_heads=4,
            latency_ms_median=0.1 * L / 128 * (2 if way == "b" else 1),
        )
        for way in ("a", "b")
        for L in (128, 1024)
        for P in (2048.0, 8192.0)
    ]
    out = figures.lines(pd.DataFrame(rows), "seq_len", "latency_ms_median", "?", "ms", "L")
    assert len(out) == 1 and len(drawn) == 1
    titles, axes = drawn[0]
    assert titles == ["kv_cache_len=2048", "kv_cache_len=8192"], titles
    assert axes and all(labels == ["128", "1024"] for labels in axes), axes
    assert out[0].lines == 2 and out[0].legend == 2  # a line per way, in one legend (structure)


def test_a_check_only_report_opens_with_the_verdict_per_way_above_the_fold(chromium, tmp_path):
    """A check_only sweep of wrong modules: the report's first table names each failing way once
    with what it computes and the fix, within a 1280 x 800 window's first screen; the timing
    sections it cannot fill are left out; the console said the same, one line per way."""
    negative = Path(__file__).parent / "negative"
    proc = run_harness(
        "--config-dir", str(negative), "-m",
        "variant=no_permute,softmax_wrong_axis,mask_not_applied,reference",
        "mask=none,causal", "check_only=true", *TINY, "hydra.sweep.dir=sweep",
        cwd=tmp_path, paths=[negative],
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-2000:]
    failed = [ln for ln in proc.stderr.splitlines() if ln.startswith("check failed: ")]
    assert [ln.split(":")[1].strip() for ln in failed] == [
        "no_permute",
        "softmax_wrong_axis",
        "mask_not_applied",
    ], failed  # one line per way, whatever its number of failing points
    assert "mask_not_applied: mismatch at 1 of 2 points" in failed[2], failed[2]
    chromium.set_window_size(1280, 800)
    chromium.get((tmp_path / "sweep" / "report.html").as_uri())
    table = chromium.execute_script(
        "const t = document.getElementById('verdict-table'); const r = t.getBoundingClientRect();"
        "return {bottom: r.bottom, right: r.right, height: window.innerHeight,"
        " width: document.documentElement.clientWidth,"
        " rows: [...t.querySelectorAll('tbody tr')].map(tr => [...tr.cells].map(c => c.innerText))}"
    )
    assert table["bottom"] <= table["height"], table  # above the fold, at 1280 x 800
    assert table["right"] <= table["width"], table  # and no column off-screen
    ways = [row[0] for row in table["rows"]]
    # nn.MHA named as the findings and figures name it (issue 74)
    wrong = ["no_permute", "softmax_wrong_axis", "mask_not_applied"]
    assert ways == [*wrong, "nn.MultiheadAttention"], ways
    permute = table["rows"][0]
    assert permute[1] == "mismatch" and permute[2] == "2 of 2", permute
    assert "heads merged without the permute" in permute[3] and "transpose(1, 2)" in permute[4]
    assert table["rows"][3][1] == "passes"
    present = chromium.execute_script(
        "return ['best', 'effects', 'compile', 'not-timed'].map(i => !!document.getElementById(i))"
    )
    assert present == [False, False, False, True], present  # no empty timing sections


def test_a_trace_dir_cell_is_a_file_link_never_a_script(chromium, tmp_path):
    """A results.csv is data: a ``trace_dir`` of ``javascript:...`` is a file name in the report
    (percent-encoded, relative), one outside the run's dir is no link at all, and the page's
    Content-Security-Policy runs no script whatever it holds."""
    root = tmp_path / "run"
    (root / "traces" / "p0").mkdir(parents=True)
    base = dict(variant="fused", label="fused", status="ok", batch=1, seq_len=8, embed_dim=16,
                num_heads=2, dtype="float32", device="cpu", mask="none")  # fmt: skip
    cells = ["traces/p0", "javascript:document.title='PWNED'", "../../outside"]
    pd.DataFrame([{**base, "seed": i, "trace_dir": c} for i, c in enumerate(cells)]).to_csv(
        root / "results.csv", index=False
    )
    html = report.render_dir(root, tmp_path / "reports")
    chromium.get(html.as_uri())
    links = chromium.execute_script(
        "return [...document.querySelectorAll('a[href]')].map(a => [a.textContent, a.href])"
    )
    named = {text: href for text, href in links if text in cells}
    assert named["traces/p0"].startswith("file://") and named["traces/p0"].endswith("/traces/p0")
    assert not named["javascript:document.title='PWNED'"].startswith("javascript:"), named
    assert "../../outside" not in named  # not under the run's dir: its text, no link
    assert not any(href.startswith("javascript:") for _, href in links), links
    policy = chromium.execute_script(
        "const m = document.querySelector('meta[http-equiv=\"Content-Security-Policy\"]');"
        "return m && m.content"
    )
    assert policy and "default-src 'none'" in policy
    for anchor in chromium.find_elements("css selector", "a[href]"):
        if anchor.text.startswith("javascript:"):
            anchor.click()  # a file that does not exist: nothing runs
    assert chromium.title != "PWNED"  # (a missing file's page is titled with its URL)


def test_nothing_in_a_report_runs_whatever_its_files_hold(chromium, tmp_path):
    """Issue 58: ``<script>``, an ``onerror`` attribute and ``javascript:`` in every text field
    of results.csv and env.json that a report renders (names, labels, errors, diagnoses,
    overrides, the machine's strings): each is shown as text, the page holds no script, no
    event attribute and no ``javascript:`` link, and nothing ran."""
    import json

    from harness import schema

    def payload(name):
        return (
            f"{name}<script>document.title='PWNED'</script>"
            f"<img src=x onerror=\"document.title='PWNED'\">javascript:document.title='PWNED'"
        )

    enums = {"status", "mode", "dtype", "device", "mask", "mask_format", "sdpa_backend",
             "kv_cache", "timing_state", "timed_by", "rerun_noise_from", "config_hash"}  # fmt: skip
    kinds = ("text", "name", "names", "dotted path", "path")
    texts = [c.name for c in schema.ROW if c.unit in kinds and c.name not in enums]
    base = dict(status="ok", batch=1, seq_len=8, embed_dim=16, num_heads=2, dtype="float32",
                device="cpu", mask="none", mode="fwd", timing_state="done")  # fmt: skip
    rows = []
    for i, (status, ms) in enumerate((("ok", 1.0), ("ok", 0.8), ("mismatch", 0.9))):
        # two ways at one shape (seed 0): a shape's fastest way is shown, its variant's name too
        row = {**base, **{c: payload(c) + str(i) for c in texts}, "status": status, "seed": i // 2}
        row["n_samples"] = 5
        row.update(latency_ms_median=ms, latency_ms_ci_low=ms * 0.95, latency_ms_ci_high=ms * 1.05,
                   speedup=1 / ms, speedup_ci_low=0.95 / ms, speedup_ci_high=1.05 / ms)  # fmt: skip
        rows.append(row)
    root = tmp_path / "run"
    root.mkdir()
    pd.DataFrame(rows).to_csv(root / "results.csv", index=False)
    (root / "env.json").write_text(
        json.dumps({k: payload(k) for k in ("torch", "hostname", "cpu", "gpu", "python")})
    )
    from harness.report import compare

    html = report.render_dir(root, tmp_path / "reports")
    compared = tmp_path / "compare.html"
    compare.main([str(root), str(root), "--out", str(compared)])
    for page_file in (compared, html):  # the report last: its text is checked below
        chromium.get(page_file.as_uri())
        page = _page(chromium)
        assert page["scripts"] == 0 and page["handlers"] == [] and page["urls"] == [], page
        assert chromium.title != "PWNED"
    shown = [c for c in texts if f"{c}<script>document.title='PWNED'</script>" in page["text"]]
    assert {"label", "error", "variant"} <= set(shown), shown  # escaped: shown as text


def _page(chromium) -> dict:
    """What could run in the page: script elements, event attributes, javascript: URLs."""
    return chromium.execute_script(
        "const all = [...document.querySelectorAll('*')];"
        "return {scripts: document.querySelectorAll('script').length,"
        " handlers: all.flatMap(e => [...e.attributes].filter(a => a.name.startsWith('on'))"
        "   .map(a => e.tagName + ' ' + a.name)),"
        " urls: all.flatMap(e => ['href', 'src', 'action', 'formaction']"
        "   .map(n => e.getAttribute(n) || '')).filter(u => /^\\s*javascript:/i.test(u)),"
        " text: document.body.innerText}"
    )
