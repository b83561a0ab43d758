"""The check's verdict per way (harness/report/verdicts.py): failing points grouped by way and
by what they say, the machine's limits in one short line each, the passing ways named once."""

import pandas as pd

from harness.progress import result_line
from harness.report import verdicts

SHAPE = dict(batch=1, seq_len=8, embed_dim=16, num_heads=2, dtype="float32", device="cpu")
LONG = "InductorError: LoweringException: " + "x" * 400 + "\nsecond line"


def _row(variant, status, mask="none", **kw):
    return {**SHAPE, "variant": variant, "label": variant, "status": status, "mask": mask, **kw}


def _mismatch(variant, mask, says="it computes nn.MHA with the softmax over the queries"):
    return _row(
        variant, "mismatch", mask, diagnosis_says=says, diagnosis_fix="softmax(dim=-1)",
        wrong_where="Where: the output differs in all 2 heads.", worst_tensor="out",
        max_abs_err=0.9, tolerance=2e-5, error=f"out: max_abs_err=0.9 ... Diagnosis: {says}",
    )  # fmt: skip


ROWS = pd.DataFrame(
    [
        _mismatch("axis", "none"),
        _mismatch("axis", "causal"),
        _mismatch("axis", "padding", says="none of the 20 known mistakes that show here matches"),
        _row("fused", "ok"),
        _row("fused", "ok", "causal"),
        _row("flexy", "unsupported", error=LONG),
        _row("flexy", "unsupported", "causal", error=LONG),
        _row("crashy", "crashed", error="the worker process died (SIGKILL)"),
    ]
)


def test_failures_are_grouped_by_way_and_by_what_they_say():
    table = {v.way: v for v in verdicts.verdicts(ROWS)}
    axis = table["axis"]
    assert axis.word == "fails" and axis.points == 3 and axis.n_failed == 3
    assert [len(g.cases) for g in axis.failed] == [2, 1]  # two diagnoses: two groups
    assert axis.failed[0].fix == "softmax(dim=-1)" and axis.failed[0].where.endswith("2 heads")
    assert table["fused"].word == "passes" and table["fused"].passed == 2
    assert table["flexy"].word == "not run" and len(table["flexy"].limits) == 1
    assert table["crashy"].failed[0].says == "the worker process died (SIGKILL)"


def test_the_console_says_each_group_once_and_cuts_a_long_reason_to_one_line():
    lines = verdicts.lines(verdicts.verdicts(ROWS))
    failed = [ln for ln in lines if ln.startswith("check failed: ")]
    assert len(failed) == 3, lines  # axis twice (two diagnoses), crashy once
    assert failed[0].startswith("check failed: axis: mismatch at 2 of 3 points: it computes")
    assert "; fix: softmax(dim=-1); worst: out: error 0.9 > tolerance 2e-05" in failed[0]
    (limit,) = [ln for ln in lines if ln.startswith("unsupported: ")]
    assert limit.startswith("unsupported: flexy at 2 of 2 points: InductorError")
    assert "second line" not in limit and "…" in limit and len(limit) < 260, limit
    assert lines[-1] == "check passed: 1 way at every point: fused"
    # the point's own progress line is cut the same way; a mismatch keeps its whole sentence
    point = result_line(ROWS.iloc[5].to_dict())
    assert "second line" not in point and point.endswith("(the whole text: errors.log)")
    assert "Diagnosis: it computes" in result_line(ROWS.iloc[0].to_dict())


def test_the_report_names_many_passing_ways_in_one_row():
    many = pd.DataFrame([_row(f"way{i}", "ok") for i in range(verdicts.PASSED_ROWS + 1)])
    rows = verdicts.report_rows(many)
    assert len(rows["rows"]) == 1 and rows["rows"][0]["names"].startswith("way0, way1")
    assert rows["failing"] == 0 and rows["passing"] == verdicts.PASSED_ROWS + 1
    few = verdicts.report_rows(ROWS)
    assert [r["way"] for r in few["rows"]] == ["axis", "axis", "crashy", "flexy", "fused"]


def test_an_untimed_report_renders_without_importing_matplotlib(tmp_path):
    """A check_only run draws no figure: its report must not pay for matplotlib and seaborn
    (a second of a one-point check's few)."""
    import subprocess
    import sys

    ROWS.to_csv(tmp_path / "results.csv", index=False)
    code = (
        "import sys; from pathlib import Path; from harness.report.render import render_dir; "
        f"render_dir(Path({str(tmp_path)!r}), Path({str(tmp_path / 'out')!r})); "
        "print(sorted(m for m in ('matplotlib', 'seaborn') if m in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]", proc.stdout
    assert 'id="verdict-table"' in (tmp_path / "report.html").read_text()


def test_a_ways_none_failures_are_one_line_with_their_true_count():
    """Issue 73: "none of the 27 known mistakes" at 8 points and "none of the 22" at 4 (fewer
    mistakes show at some points) read as two lines, "8 of 12" and "4 of 12", for a way that
    failed at all 12."""
    rows = pd.DataFrame(
        [_mismatch("mine", f"m{i}", says="none of the 27 known mistakes that show here matches")
         for i in range(8)]
        + [_mismatch("mine", f"n{i}", says="none of the 22 known mistakes that show here matches")
           for i in range(4)]
        + [_mismatch("mine", "x", says="it computes nn.MHA with the softmax over the queries")]
    )  # fmt: skip
    said = [line for line in verdicts.lines(verdicts.verdicts(rows)) if "check failed" in line]
    assert len(said) == 2, said
    assert "mismatch at 12 of 13 points: none of the 22-27 known mistakes" in said[0], said
    assert "at 1 of 13 points: it computes nn.MHA with the softmax" in said[1], said
