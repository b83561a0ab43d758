"""Any two named ways paired: ``mha-bench paired DIR --ways A B`` on a sweep with a
planted 1.2x difference (tests/paced/: the same forward 6 and 5 times per call) gives an
interval that covers 1.2 at every shape and overall (at twice its half-width: see the test), and
the report shows it."""

import pandas as pd
import pytest

from harness.report import paired
from harness.report.effects import summarize_pairs
from tests.conftest import REPO

PACED = REPO / "tests" / "paced"


def widened(center: float, low: float, high: float, factor: float) -> tuple[float, float]:
    """The interval ``[low, high]`` around ``center`` with its log half-widths times ``factor``."""
    return (
        center * (low / center) ** factor,
        center * (high / center) ** factor,
    )


@pytest.mark.slow  # a paced sweep timed in rounds (25 s here): make test-slow and CI run it
def test_a_planted_1_2x_difference_is_found_with_an_interval_that_covers_it(
    harness_cli, tmp_path, capsys
):
    proc = harness_cli(
        "-m",
        "--config-dir",
        str(PACED / "conf"),
        "variant=six_ms,five_ms",
        "seq_len=64,128",
        "embed_dim=64",
        "num_heads=4",
        "timing.rounds=8",
        "timing.round_time=0.2",
        "num_threads=1",  # two OpenMP threads on a loaded 2-core machine stall for seconds
        "hydra.sweep.dir=sweep",
        paths=[PACED],
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    root = tmp_path / "sweep"
    code = paired.main([str(root), "--ways", "six_ms", "five_ms", "--no-report"])
    table = pd.read_csv(root / paired.PAIRED_FILE)
    # a pairing the busy machine left undecided exits 3, as compare's "not comparable"
    assert code == (3 if table["verdict"].iloc[-1] == "busy" else 0), table
    assert list(table["shape"])[-1] == "all shapes" and len(table) == 3  # two shapes, overall
    for row in table.to_dict("records"):
        if row["verdict"] == "busy":  # the machine was busy for this shape's rounds: no figure
            continue
        # A 95% interval misses the truth one run in 20, and three are asserted here: the test
        # would fail one CI run in 7 on a calibrated method (it did, once: 1.09x [1.01, 1.18]).
        # Widened to twice its half-width on the log scale (~99.8% with these rounds) it fails
        # less than once in 150 runs, while a ratio off by its interval's whole width still fails.
        low, high = widened(row["ratio"], row["ratio_ci_low"], row["ratio_ci_high"], 2.0)
        assert low <= 1.2 <= high, row
        assert 1.05 < row["ratio"] < 1.4, row  # the interval's work; this catches a wrong sign
    shapes = table.iloc[:2]
    measured = shapes[shapes["verdict"] != "busy"]  # a busy shape's rounds did not pair
    assert (measured["basis"] == "rounds").all(), shapes  # from the journal, not speedups
    # the overall line agrees with its shapes: where both say B is faster, so does their pool
    # (a busy machine may widen a shape's interval to a tie: then nothing is asserted of it; the
    # pooling itself is checked on fixed numbers below)
    verdicts = list(table["verdict"])
    assert "slower" not in verdicts, table
    if verdicts[:2] == ["faster", "faster"]:
        assert verdicts[2] == "faster", table
    out = capsys.readouterr().out
    assert "all shapes" in out
    # where the two shapes say the same, the overall line does not call them different (a loaded
    # machine may leave one shape's interval too wide to tell: then they do differ, and say so)
    if verdicts[0] == verdicts[1]:
        assert "the shapes differ" not in out, out
    # the report shows it once it was asked for
    from harness.report.render import render_dir

    html = render_dir(root, tmp_path / "reports").read_text()
    assert 'id="paired"' in html and "five_ms" in html


def test_a_label_that_names_no_way_or_several_is_refused_in_one_line(tmp_path, capsys):
    rows = pd.DataFrame(
        [
            dict(
                variant="fused",
                label="fused/a",
                status="ok",
                latency_ms_median=1.0,
                batch=1,
                seq_len=8,
                embed_dim=16,
                num_heads=2,
                dtype="float32",
                device="cpu",
                mask="none",
                mode="fwd",
            ),
            dict(
                variant="fused",
                label="fused/b",
                status="ok",
                latency_ms_median=1.0,
                batch=1,
                seq_len=8,
                embed_dim=16,
                num_heads=2,
                dtype="float32",
                device="cpu",
                mask="none",
                mode="fwd",
            ),
        ]
    )
    rows.to_csv(tmp_path / "results.csv", index=False)
    assert paired.main([str(tmp_path), "--ways", "nope", "fused/a", "--no-report"]) == 2
    assert "'nope' names no timed way" in capsys.readouterr().err
    assert paired.main([str(tmp_path), "--ways", "fused", "fused/a", "--no-report"]) == 2
    err = capsys.readouterr().err
    assert "'fused' names 2 ways" in err and "name one" in err


def test_a_sweep_dir_paired_cannot_write_is_one_line_after_the_answer(tmp_path, capsys,
                                                                      monkeypatch):  # fmt: skip
    """Issue 74: ``paired`` on a read-only sweep dir ended in WriteError's traceback."""
    from harness.files import WriteError

    rows = [
        dict(variant=v, label=v, status="ok", latency_ms_median=ms, speedup=1 / ms, batch=1,
             seq_len=8, embed_dim=16, num_heads=2, dtype="float32", device="cpu", mask="none",
             mode="fwd")
        for v, ms in (("fused", 1.0), ("separate", 1.2))
    ]  # fmt: skip
    pd.DataFrame(rows).to_csv(tmp_path / "results.csv", index=False)

    def refuse(path, text):
        raise WriteError(30, f"cannot write {path}: Read-only file system")

    monkeypatch.setattr(paired, "atomic_write_text", refuse)
    assert paired.main([str(tmp_path), "--ways", "fused", "separate"]) == 3
    out, err = capsys.readouterr()
    assert "A = fused" in out and "all shapes" in out  # the answer, printed first
    assert err.strip().startswith("error: cannot write") and len(err.strip().splitlines()) == 1


def test_the_eager_way_of_a_compiled_pair_is_named_by_its_way_or_with_compile_off():
    """A way and its compiled copy share their label (issue 57): the way as the report prints it
    names the eager one alone, as does the label with " +compile=off"; the compiled one is named
    with its suffix; the label alone still names both (and paired asks for one)."""
    base = dict(variant="fused", label="fused/a", sdpa_backend="auto", kv_cache="")
    rows = [{**base, "compile": "off"}, {**base, "compile": "default"}]
    for label, named in (
        ("fused/a", ["off"]),
        ("fused/a +compile=off", ["off"]),
        ("fused/a +compile=default", ["default"]),
        ("fused", ["off", "default"]),
    ):
        pick = paired.chooser(rows, label)
        assert [r["compile"] for r in rows if pick(r)] == named, label


def shapes(*triples, floor=0.04):
    return pd.DataFrame(
        [
            dict(
                shape=f"s{i}",
                ratio=c,
                ratio_ci_low=lo,
                ratio_ci_high=hi,
                verdict="faster" if lo > 1 else "slower" if hi < 1 else "tie",
                rerun_noise=floor,
            )
            for i, (c, lo, hi) in enumerate(triples)
        ]
    )


def test_the_overall_line_pools_the_shapes_intervals_and_agrees_with_them():
    """Two shapes that both say B is faster (the issue's figures): the spread between two
    ratios under a t interval with one degree of freedom read "no difference" (0.689 to 2.82);
    the shapes' own intervals combined agree with them."""
    table = shapes((1.47, 1.29, 1.68), (1.32, 1.20, 1.46))
    spread = summarize_pairs(table)
    assert spread["verdict"] == "tie" and spread["ratio_ci_low"] < 0.7  # what read wrong
    pooled = summarize_pairs(table, pooled=True)
    assert pooled["verdict"] == "faster", pooled
    assert 1.38 < pooled["ratio"] < 1.40
    assert 1.2 < pooled["ratio_ci_low"] < 1.32 and 1.47 < pooled["ratio_ci_high"] < 1.6
    # the floor is in once, not shrunk by the number of shapes: never narrower than the floor
    same = summarize_pairs(shapes(*[(1.2, 1.2 / 1.081, 1.2 * 1.081)] * 8), pooled=True)
    assert same["ratio_ci_low"] < 1.2 / 1.07
    # one shape without an interval: none overall
    assert (
        summarize_pairs(shapes((1.3, 1.2, 1.4), (1.2, float("nan"), float("nan"))), pooled=True)[
            "verdict"
        ]
        == "tie"
    )


def test_the_overall_line_says_when_its_shapes_disagree():
    table = shapes((1.3, 1.2, 1.4), (0.8, 0.75, 0.85))
    overall = {"shape": "all shapes", **summarize_pairs(table, pooled=True)}
    assert paired.split(table, overall) == "; the shapes differ: 1 B faster, 1 B slower"
    assert paired.split(shapes((1.3, 1.2, 1.4), (1.2, 1.1, 1.3)), overall) == ""


@pytest.mark.parametrize("module", ["paired", "compare", "render", "tensorboard"])
def test_a_commands_help_says_its_whole_first_sentence(module, capsys):
    """--help's description is the docstring's first paragraph (issue 57: paired's stopped at
    "is transformers' sdpa attention as")."""
    import importlib

    mod = importlib.import_module(f"harness.report.{module}")
    with pytest.raises(SystemExit):
        mod.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    first = " ".join(mod.__doc__.strip().split("\n\n")[0].split())
    assert first in text and text.startswith("usage: mha-bench ")
