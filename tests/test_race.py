"""``mha-bench race``: your module against every built-in way at your shape, ending with a
recommendation read off what was measured (harness/report/race.py): the way to use, which of its
factors matter and which tie, and your module against it paired round by round."""

import math
import subprocess
import sys

import pandas as pd
import pytest

from harness import cli
from harness.report import race
from tests.conftest import REPO, harness_env

PACED = REPO / "tests" / "paced"


@pytest.mark.slow  # a sweep of 14 points timed in rounds (13 s here): make test-slow and CI run it
def test_race_names_the_way_to_use_and_how_much_slower_your_module_is(tmp_path):
    # five_ms computes the fused module's forward 5 times per call: several times slower than
    # every built-in way, which a busy machine cannot turn around (it can only leave it undecided)
    proc = subprocess.run(
        [sys.executable, "-m", "harness.cli", "race", "five_ms", "--config-dir",
         str(PACED / "conf"), "batch=1", "seq_len=32", "embed_dim=32", "num_heads=2",
         "variant.attention=manual,sdpa", "timing.rounds=4", "timing.round_time=0.005",
         "num_threads=1", "hydra.sweep.dir=sweep"],
        cwd=tmp_path, env=harness_env(PACED), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("finding: race: "))
    rows = pd.read_csv(tmp_path / "sweep" / "results.csv")
    # every built-in file of conf/variant ran beside yours, at your one shape
    assert set(rows["variant"]) == {"five_ms", "fused", "packed", "reference", "separate"}
    assert (rows["status"] == "ok").all(), rows[["variant", "status", "error"]]
    assert "B=1 L=32 E=32 H=2" in line, line
    if "machine was busy" in line:  # undecided, and said so: nothing else may be claimed
        assert "use " not in line, line
        return
    assert ": use " in line and "your module five_ms is " in line and "slower than it" in line
    ratio = float(line.split("your module five_ms is ")[1].split("x")[0])
    assert ratio > 2, line  # 5 forwards against one: far beyond any interval
    way = line.split(": use ")[1].split("(the fastest measured: ")[-1].split(" (")[0]
    way = way.split(";")[0].rstrip(")")
    assert way.split("/")[0] in ("fused", "packed", "separate", "nn.MultiheadAttention"), line
    # the report opens with the same sentence
    html = (tmp_path / "sweep" / "report.html").read_text()
    assert line.removeprefix("finding: race: ")[:60] in html


def _row(variant, ms, speedup, target=None, **kw):
    shape = dict(batch=1, seq_len=8, embed_dim=16, num_heads=2, dtype="float32", device="cpu")
    return {
        **shape,
        "mask": "none",
        "variant": variant,
        "label": kw.pop("label", variant),
        "variant_target": target or f"variants.{variant.split('/')[0]}.X",
        "status": "ok",
        "latency_ms_median": ms,
        "latency_ms_ci_low": ms * 0.97,
        "latency_ms_ci_high": ms * 1.03,
        "speedup": speedup,
        "speedup_ci_low": speedup * 0.97,
        "speedup_ci_high": speedup * 1.03,
        "n_samples": 5,
        "config_hash": variant + str(ms),
        **kw,
    }


def _analyzed(rows):
    from harness.report.analysis import analyze

    return analyze(pd.DataFrame(rows))


def _ways(attention, merge, ms):
    return _row(
        "fused", ms, 2.0 / ms, variant_options=f"attention={attention} merge={merge}",
        label=f"fused/attention={attention},merge={merge}",
    )  # fmt: skip


def test_a_factor_that_ties_makes_no_difference_and_one_that_wins_is_said_with_its_interval():
    rows = [
        _ways("sdpa", "view", 1.0),
        _ways("sdpa", "reshape", 1.0),
        _ways("manual", "view", 1.5),
        _ways("manual", "reshape", 1.5),
        _row("reference", 2.0, 1.0),
        _row("mine", 3.0, 2.0 / 3.0, target="mine.MyAttention"),
    ]
    said = [f["text"] for f in _analyzed(rows).findings if f["factor"] == "race"]
    assert len(said) == 1, said
    text = said[0]
    assert ": use attention=sdpa (the fastest measured: fused/attention=sdpa," in text, text
    assert "attention=sdpa: 1.50x [" in text and "faster than manual" in text, text
    assert "merge makes no difference here" in text, text
    assert "your module mine is 3.00x [" in text and "slower than it" in text, text


def test_a_module_of_yours_that_failed_its_check_is_named_with_its_diagnosis_not_raced():
    bad = _row("mine", math.nan, math.nan, target="mine.MyAttention", status="mismatch")
    bad["diagnosis"] = "heads_merged_without_permute"
    bad["diagnosis_says"] = "it computes nn.MHA with the heads merged without the permute"
    rows = [_ways("sdpa", "view", 1.0), _row("reference", 2.0, 1.0), bad]
    text = next(f["text"] for f in _analyzed(rows).findings if f["factor"] == "race")
    assert "your module mine is mismatch: it computes nn.MHA with the heads merged" in text, text
    assert "it was not raced" in text and ": use fused/attention=sdpa,merge=view" in text, text


def test_a_module_of_yours_that_does_not_import_is_named():
    """Issue 74: its row is invalid before its device is resolved (device=auto), a shape no
    timed row has: the race said nothing of it."""
    bad = _row("mine", math.nan, math.nan, target="mine.MyAttention", status="invalid",
               device="auto")  # fmt: skip
    bad["error"] = "variant='mine': cannot import _target_ 'mine.MyAttention': mine imports 'x'"
    rows = [_ways("sdpa", "view", 1.0), _row("reference", 2.0, 1.0), bad]
    said = [f["text"] for f in _analyzed(rows).findings if f["factor"] == "race"]
    assert any("your module mine is invalid: variant='mine': cannot" in t for t in said), said
    assert any("it was not raced" in t for t in said), said


def test_a_busy_shape_decides_nothing():
    rows = [
        _ways("sdpa", "view", 1.0),
        _row("reference", 2.0, 1.0, contended=True),
        _row("mine", 3.0, 2.0 / 3.0, target="mine.MyAttention"),
    ]
    text = next(f["text"] for f in _analyzed(rows).findings if f["factor"] == "race")
    assert "not decided: the machine was busy" in text and "use " not in text, text
    # issue 74: a module of yours that failed its check is named on a busy machine too
    bad = _row("mine", math.nan, math.nan, target="mine.MyAttention", status="mismatch")
    bad["diagnosis_says"] = "it computes nn.MHA with the heads merged without the permute"
    text = next(f["text"] for f in _analyzed(rows[:2] + [bad]).findings if f["factor"] == "race")
    assert "not decided: the machine was busy" in text, text
    assert "your module mine is mismatch: it computes nn.MHA with the heads merged" in text, text


def test_no_race_finding_without_a_module_of_yours():
    rows = [_ways("sdpa", "view", 1.0), _row("reference", 2.0, 1.0)]
    assert not [f for f in _analyzed(rows).findings if f["factor"] == "race"]
    assert race.yours({"variant_target": "examples.mine.MyAttention"})
    assert not race.yours({"variant_target": "variants.fused.FusedQKVMHA"})


def test_race_gives_every_way_your_variants_fixed_keys_unless_the_command_line_sets_them():
    flags, overrides = cli.hydra_flags(
        ["seq_len=64", "--config-dir", "examples/conf", "mask=causal"]
    )
    assert flags == ["--config-dir", "examples/conf"] and overrides == ["seq_len=64", "mask=causal"]
    assert cli.fixed_keys(["mine"], flags, overrides) == [
        "bias=false"
    ]  # examples/conf/variant/mine.yaml
    assert cli.fixed_keys(["mine"], flags, ["bias=true"]) == []
    assert cli.fixed_keys(["fused"], flags, overrides) == []


def test_a_variant_beside_its_yaml_imports_without_pythonpath(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.chdir(tmp_path)
    cli.importable(["--config-dir", "mydir", "seq_len=8"])
    assert sys.path[-2:] == [str(tmp_path), str(tmp_path / "mydir")]


def test_race_refuses_an_override_in_place_of_its_variant(capsys):
    assert cli.main(["race", "seq_len=8"]) == 2
    assert "is not a variant name" in capsys.readouterr().err
    assert cli.main(["race", "--help"]) == 0
    assert "mha-bench race VARIANT" in capsys.readouterr().out


def test_kernels_on_the_command_line_is_spelled_out_as_in_a_preset():
    from harness.sweep.run import scoped_variant_options
    from harness.way.kernels import everywhere

    out = scoped_variant_options(["-m", "variant.attention=kernels()", "seq_len=8"])
    assert out == ["-m", f"variant.attention={','.join(everywhere())}", "seq_len=8"]


def test_the_console_script_exits_with_the_commands_code_its_output_flushed():
    # harness.cli.console ends with os._exit (no interpreter teardown): what was printed, and
    # the exit code, must still arrive
    code = "import sys; from harness.cli import console; sys.argv[0] = 'mha-bench'; console()"
    for args, rc, stream, text in (
        (["race", "seq_len=8"], 2, "stderr", "is not a variant name"),
        (["race", "--help"], 0, "stdout", "usage: mha-bench race VARIANT"),
    ):
        proc = subprocess.run(
            [sys.executable, "-c", f"import sys; sys.argv[1:] = {args!r}; {code}"],
            capture_output=True, text=True, timeout=120, env=harness_env(),
        )  # fmt: skip
        assert proc.returncode == rc and text in getattr(proc, stream), proc


def test_race_refuses_in_one_line_what_it_would_otherwise_run_wrongly(tmp_path, capsys):
    """Issue 74: ``variant=`` raced only that variant, without a word; a yaml named like a
    built-in was silently ignored; a bad ``_fixed_`` value was refused after the sweep's dir was
    made."""
    (tmp_path / "variant").mkdir()
    (tmp_path / "variant" / "fused.yaml").write_text((PACED / "conf/variant/five_ms.yaml")
                                                     .read_text())  # fmt: skip
    (tmp_path / "variant" / "mine.yaml").write_text(
        "_target_: variants.fused.FusedQKVMHA\nattention: sdpa\nmerge: view\n"
        "_fixed_:\n  mask: bogus\n"
    )
    out = tmp_path / "out"
    for args, words in (
        (["mine", "--config-dir", str(tmp_path), "variant=fused"], "drop variant="),
        (["fused", "--config-dir", str(tmp_path)], "has the name of a built-in way"),
        (["mine", "--config-dir", str(tmp_path)], "_fixed_.mask='bogus' is not one of"),
    ):
        assert cli.main(["race", *args, "seq_len=8", f"hydra.sweep.dir={out}"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and words in err and len(err.splitlines()) == 1, err
        assert not out.exists()
