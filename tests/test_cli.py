"""End to end through the real Hydra app: single runs, multiruns, presets, outside variants."""

import hashlib
import json
import re
import textwrap
from pathlib import Path

import pandas as pd
import pytest

from harness.config import InvalidPoint
from harness.results import COLUMNS
from harness.factory import make_point
from tests.conftest import PLAIN, TINY, VARIANT_NAMES, WAYS

REQUIRED = (
    "variant compile batch seq_len embed_dim num_heads dtype device mask status error "
    "latency_ms_median latency_ms_iqr n_samples check_passed max_abs_err max_rel_err"
).split()


def last_line(proc) -> str:
    return proc.stdout.strip().splitlines()[-1]


def report_path(proc, cwd: Path) -> Path:
    line = last_line(proc)
    assert line.startswith("report: "), proc.stdout[-2000:] + proc.stderr[-2000:]
    return cwd / line.removeprefix("report: ")


def test_required_columns_are_in_the_schema():
    assert set(REQUIRED) <= set(COLUMNS)


def test_single_run_writes_row_results_and_report(harness_cli, tmp_path):
    proc = harness_cli("variant=packed", "mask=causal", *TINY, "hydra.run.dir=out/run")
    assert proc.returncode == 0, proc.stderr
    run = tmp_path / "out" / "run"
    row = pd.read_csv(run / "result.csv")
    results = pd.read_csv(run / "results.csv")
    assert len(row) == 1 and len(results) == 1
    r = results.iloc[0]
    assert (r["variant"], r["status"], bool(r["check_passed"]), r["mask"]) == (
        "packed",
        "ok",
        True,
        "causal",
    )
    assert r["latency_ms_median"] > 0 and r["n_samples"] >= 2
    assert r["variant_options"] == "attention=sdpa merge=view"
    html = report_path(proc, tmp_path)
    assert html.exists() and "<table" in html.read_text()


def test_the_sweeps_own_process_imports_no_torch(tmp_path):
    """The job process leaves torch to its point's worker (2-3 s of CPU a sweep): env.json's
    facts and ways.json's declarations are the worker's answers, the same as read here, and
    ``device=auto`` resolves from them."""
    import subprocess
    import sys

    import torch

    from harness.sweep.facts import ways_of
    from tests.conftest import harness_env

    code = (
        "import sys\nfrom harness.cli import run\ntry:\n"
        f"    run(['-m', 'variant=fused,separate', {', '.join(map(repr, TINY))}, "
        "'check_only=true', 'hydra.sweep.dir=sweep'])\n"
        "finally:\n    print('torch imported:', 'torch' in sys.modules, file=sys.stderr)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=harness_env(), capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    assert "torch imported: False" in proc.stderr, proc.stderr[-2000:]
    env = json.loads((tmp_path / "sweep" / "env.json").read_text())
    assert env["torch"] == str(torch.__version__) and env["gpu_count"] == torch.cuda.device_count()
    df = pd.read_csv(tmp_path / "sweep" / "results.csv")
    assert set(df["status"]) == {"ok"} and len(df) == 2
    assert set(df["device"]) == {"cuda" if torch.cuda.is_available() else "cpu"}
    written = json.loads((tmp_path / "sweep" / "ways.json").read_text())
    assert written == json.loads(ways_of(df).to_json()) and written["kernels"]["manual"]["title"]


@pytest.mark.slow  # a sweep of every variant timed (20 s here): make test-slow and CI run it
def test_multirun_every_variant_one_row_per_point(harness_cli, tmp_path):
    proc = harness_cli(
        "-m",
        PLAIN,
        "seq_len=8,12",
        "dtype=float32,bfloat16",
        *[a for a in TINY if not a.startswith("seq_len")],
        "hydra.sweep.dir=sweep",
    )
    assert proc.returncode == 0, proc.stderr
    df = pd.read_csv(tmp_path / "sweep" / "results.csv")
    n = len(WAYS) * 2 * 2
    assert len(df) == n
    assert list(df.columns[: len(COLUMNS)]) == COLUMNS
    assert set(df["variant"]) == set(WAYS)
    assert (df["status"] == "ok").all(), df[["label", "dtype", "status", "error"]]
    assert df["check_passed"].all()
    assert len(df.drop_duplicates(["variant", "seq_len", "dtype"])) == n
    # progress and one line per point, not Hydra's bare job list
    assert f"sweep: {n} points" in proc.stdout
    assert f"[{n}/{n} " in proc.stdout and "left]" in proc.stdout
    assert report_path(proc, tmp_path).exists()


@pytest.mark.slow  # a sweep of every toggle (15 s here): make test-slow and CI run it
def test_toggles_are_sweepable_and_recorded(harness_cli, tmp_path):
    proc = harness_cli(
        "-m",
        "variant=fused",
        "variant.attention=manual,sdpa",
        "variant.merge=view,reshape",
        *TINY,
        "hydra.sweep.dir=sweep",
    )
    assert proc.returncode == 0, proc.stderr
    df = pd.read_csv(tmp_path / "sweep" / "results.csv")
    assert sorted(df["label"]) == [
        "fused/attention=manual,merge=reshape",
        "fused/attention=manual,merge=view",
        "fused/attention=sdpa,merge=reshape",
        "fused/attention=sdpa,merge=view",
    ]
    assert (df["status"] == "ok").all()


@pytest.mark.slow  # a preset's sweep (15 s here): make test-slow and CI run it
def test_sweep_preset_is_one_word_and_cli_narrows_it(harness_cli, tmp_path):
    proc = harness_cli("sweep=smoke", "variant=reference,fused", "hydra.sweep.dir=sweep")
    assert proc.returncode == 0, proc.stderr
    df = pd.read_csv(tmp_path / "sweep" / "results.csv")
    assert sorted(df["variant"]) == ["fused", "reference"]
    assert set(df["seq_len"]) == {16}  # the preset's shape, not config.yaml's


def test_outputs_follow_hydra_dirs_by_default_under_results(harness_cli, tmp_path):
    proc = harness_cli(*TINY)
    assert proc.returncode == 0, proc.stderr
    rows = list((tmp_path / "results" / "runs").glob("*/result.csv"))
    assert len(rows) == 1
    assert report_path(proc, tmp_path).parent == tmp_path / "reports"


OUTSIDE = {
    "mine.py": '''
        """An outside variant: nn.MultiheadAttention written out with
        F.multi_head_attention_forward."""
        import torch.nn as nn

        class Mine(nn.MultiheadAttention):
            def __init__(self, embed_dim, num_heads, bias=True):
                super().__init__(embed_dim, num_heads, bias=bias, batch_first=True)
        ''',
    "wrong.py": '''
        """Scales the scores by sqrt(embed_dim) instead of sqrt(head_dim): a classic mistake."""
        import math
        import torch
        import torch.nn as nn

        class Wrong(nn.Module):
            def __init__(self, embed_dim, num_heads, bias=True):
                super().__init__()
                self.h = num_heads
                self.in_proj_weight = nn.Parameter(torch.empty(3 * embed_dim, embed_dim))
                self.in_proj_bias = nn.Parameter(torch.empty(3 * embed_dim)) if bias else None
                self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)

            def forward(self, query, key, value, key_padding_mask=None, need_weights=False,
                        attn_mask=None, average_attn_weights=True, is_causal=False):
                B, L, E = query.shape
                q, k, v = torch.nn.functional.linear(
                    query, self.in_proj_weight, self.in_proj_bias
                ).chunk(3, -1)
                q, k, v = (t.view(B, L, self.h, E // self.h).transpose(1, 2) for t in (q, k, v))
                w = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(E), dim=-1)
                out = (w @ v).transpose(1, 2).reshape(B, L, E)
                return self.out_proj(out), None
        ''',
    "variant/mine.yaml": "_target_: mine.Mine\n",
    "variant/wrong.yaml": "_target_: wrong.Wrong\n",
}


@pytest.fixture
def outside(tmp_path):
    root = tmp_path / "outside"
    for rel, text in OUTSIDE.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(textwrap.dedent(text))
    return root


def test_outside_variant_via_config_dir(harness_cli, tmp_path, outside):
    proc = harness_cli(
        "--config-dir",
        str(outside),
        "-m",
        "variant=mine,wrong,fused",
        *TINY,
        "hydra.sweep.dir=sweep",
        paths=[outside],
    )
    assert proc.returncode == 0, proc.stderr
    df = pd.read_csv(tmp_path / "sweep" / "results.csv").set_index("variant")
    assert df.loc["mine", "status"] == "ok" and bool(df.loc["mine", "check_passed"])
    assert df.loc["mine", "latency_ms_median"] > 0
    assert df.loc["wrong", "status"] == "mismatch" and not bool(df.loc["wrong", "check_passed"])
    assert df.loc["wrong", "max_abs_err"] > df.loc["wrong", "tolerance"]
    assert df.loc["wrong", "latency_ms_median"] > 0  # a wrong variant is still timed
    assert df.loc["fused", "status"] == "ok"
    # provenance: which class ran, the hash of its file, the distribution it came from
    source = (outside / "mine.py").read_bytes()
    assert df.loc["mine", "variant_target"] == "mine.Mine"
    assert df.loc["mine", "variant_source_hash"] == hashlib.sha1(source).hexdigest()[:12]
    assert pd.isna(df.loc["mine", "variant_distribution"])  # a module on PYTHONPATH: none
    assert df.loc["fused", "variant_distribution"].startswith("mha-bench ")
    env = json.loads((tmp_path / "sweep" / "env.json").read_text())
    assert env["config_dirs"] == [str(outside)] and env["threads_used"] == sorted(
        set(df["num_threads"])
    )
    assert set(env["variant_sources"]) == set(df["variant_target"])
    assert any(d.startswith("mha-bench ") for d in env["variant_distributions"])
    html = (tmp_path / "sweep" / "report.html").read_text()
    assert "mine.Mine" in html and str(outside) in html


def test_glob_includes_outside_variants(harness_cli, tmp_path, outside):
    proc = harness_cli(
        "--config-dir",
        str(outside),
        "-m",
        "variant=glob(*)",
        *TINY,
        "hydra.sweep.dir=sweep",
        paths=[outside],
    )
    assert proc.returncode == 0, proc.stderr
    df = pd.read_csv(tmp_path / "sweep" / "results.csv")
    assert set(df["variant"]) == set(VARIANT_NAMES) | {"mine", "wrong"}


BAD = [
    (["embed_dim=30", "num_heads=4"], "embed_dim=30 is not divisible by num_heads=4"),
    (["dtype=float64"], "dtype='float64'"),
    (["device=tpu"], "device='tpu'"),
    (["mask=diagonal"], "mask='diagonal'"),
    (["batch=0"], "batch=0"),
    (["seq_len=-4"], "seq_len=-4"),
    (["compile=fast"], "compile='fast'"),
]


@pytest.mark.parametrize("overrides,message", BAD, ids=[m for _, m in BAD])
def test_bad_values_are_refused_naming_the_value(overrides, message):
    """What a single run prints as its one `error:` line (run.main: `error: {InvalidPoint}`); the
    command-line path itself is exercised by the two cases below (each CLI run costs ~7 s)."""
    fields = dict(o.split("=", 1) for o in overrides)
    fields = {k: int(v) if v.lstrip("-").isdigit() else v for k, v in fields.items()}
    with pytest.raises(InvalidPoint) as caught:
        make_point("fused", **fields)
    assert message in str(caught.value)


# One value the harness refuses (the point), one the variant refuses (its ValueError, in the
# worker).
BAD_CLI = [BAD[0], (["variant=fused", "variant.merge=flatten"], "merge='flatten'")]


@pytest.mark.parametrize("overrides,message", BAD_CLI, ids=[m for _, m in BAD_CLI])
def test_bad_input_single_run_exits_nonzero_with_one_message(
    harness_cli, tmp_path, overrides, message
):
    tiny = [a for a in TINY if a.split("=")[0] not in {o.split("=")[0] for o in overrides}]
    proc = harness_cli(*tiny, *overrides, "hydra.run.dir=run")
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "result.csv").exists()


def test_unknown_variant_single_run(harness_cli, tmp_path):
    proc = harness_cli("variant=nosuch", *TINY, "hydra.run.dir=run")
    assert proc.returncode != 0
    assert "nosuch" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "result.csv").exists()


def test_unknown_variant_in_a_sweep_stops_before_any_point(harness_cli, tmp_path):
    proc = harness_cli("-m", "variant=fused,nosuch", *TINY, "hydra.sweep.dir=sweep")
    assert proc.returncode != 0
    assert "variant='nosuch'" in proc.stderr
    assert not list((tmp_path / "sweep").rglob("result.csv"))


def test_bad_point_in_a_sweep_is_recorded_invalid_and_the_sweep_goes_on(harness_cli, tmp_path):
    tiny = [a for a in TINY if not a.startswith(("embed_dim", "num_heads"))]
    proc = harness_cli(
        "-m",
        "embed_dim=16,30",
        "num_heads=4",
        "dtype=float32,float64",
        *tiny,
        "hydra.sweep.dir=sweep",
    )
    assert proc.returncode == 0, proc.stderr
    df = pd.read_csv(tmp_path / "sweep" / "results.csv")
    assert len(df) == 4
    ok = df[(df["embed_dim"] == 16) & (df["dtype"] == "float32")]
    assert list(ok["status"]) == ["ok"]
    bad = df[df["status"] == "invalid"]
    assert len(bad) == 3 and bad["latency_ms_median"].isna().all()
    assert bad["error"].str.contains("not divisible|float64").all()


CHECK_SWEEP = [
    "check_only=true",
    "dtype=float32,bfloat16",  # float16 too in tests/test_negative.py's every case
    "mask=none,causal,padding",
    "mode=fwd,fwd_bwd",
    "batch=2",
    "seq_len=6",
    "embed_dim=16",
    "num_heads=4",
]


def test_check_only_sweep_of_correct_variants_exits_zero(harness_cli, tmp_path):
    proc = harness_cli("-m", PLAIN, *CHECK_SWEEP, "hydra.sweep.dir=sweep")
    assert proc.returncode == 0, proc.stderr[-3000:]
    df = pd.read_csv(tmp_path / "sweep" / "results.csv")
    assert len(df) == len(WAYS) * 2 * 3 * 2
    assert (df["status"] == "ok").all() and df["check_passed"].all()
    assert df["latency_ms_median"].isna().all() and df["n_samples"].isna().all()  # no timing
    # out, grad_query (self-attention: one input), grads of in_proj_weight/bias,
    # out_proj.weight/bias
    assert set(df[df["mode"] == "fwd_bwd"]["tensors_checked"]) == {6}
    assert last_line(proc).startswith("report: ")


def test_check_only_with_a_wrong_outside_variant_exits_nonzero(harness_cli, tmp_path):
    negative = Path(__file__).parent / "negative"
    proc = harness_cli(
        "--config-dir",
        str(negative),
        "-m",
        "variant=fused,key_detached",
        *CHECK_SWEEP,
        "hydra.sweep.dir=sweep",
        paths=[negative],
    )
    assert proc.returncode == 1
    df = pd.read_csv(tmp_path / "sweep" / "results.csv")
    assert (df[df["variant"] == "fused"]["status"] == "ok").all()
    bad = df[(df["variant"] == "key_detached")]
    assert set(bad[bad["mode"] == "fwd"]["status"]) == {"ok"}  # forward is right
    assert set(bad[bad["mode"] == "fwd_bwd"]["status"]) == {"mismatch"}
    assert set(bad[bad["mode"] == "fwd_bwd"]["worst_tensor"]) == {"grad_in_proj_weight"}
    failures = [line for line in proc.stderr.splitlines() if line.startswith("check failed: ")]
    # one line for the way, its 6 failing points grouped: 2 dtypes x 3 masks, fwd_bwd only
    assert len(failures) == 1, failures
    (line,) = failures
    assert line.startswith("check failed: key_detached: mismatch at 6 of 12 points: "), line
    # the cause, named from the catalogue (harness/way/mistakes.py), its fix, and where it shows
    assert "it computes nn.MHA with the key path detached" in line and "; fix: " in line, line
    assert "; worst: grad_in_proj_weight: error " in line and "> tolerance " in line, line
    assert "where: the forward matches; only gradients differ" in line, line
    assert "mode=fwd_bwd" in line and "and 4 more)" in line, line
    assert "check passed: 1 way at every point: fused" in proc.stdout
    # each point's whole message, tensor, index and all, stays in its row and in errors.log
    errors = (tmp_path / "sweep" / "errors.log").read_text()
    assert errors.count("grad_in_proj_weight: max_abs_err=") >= 6 and "at index (" in errors
    assert set(bad[bad["mode"] == "fwd_bwd"]["diagnosis"]) == {"key_detached"}
    assert set(bad[bad["mode"] == "fwd_bwd"]["wrong_in"]) == {"gradients"}
    assert last_line(proc).startswith("report: ")  # the report still comes, last
    # the report's correctness table shows the diagnosis under each mismatch, and only there
    html = (tmp_path / "sweep" / "report.html").read_text()
    named = re.findall(r'<div class="detail">(.*?)</div>', html, re.S)
    assert len(named) == 6, named
    assert all(
        "it computes nn.MHA with the key path detached" in c and "only gradients differ" in c
        for c in named
    )


def test_one_command_line_dispatches_and_refuses_an_unknown_command(capsys, tmp_path):
    from harness import cli

    assert cli.main([]) == 2 and "usage: mha-bench COMMAND" in capsys.readouterr().err
    assert cli.main(["--help"]) == 0 and "tensorboard" in capsys.readouterr().out
    assert cli.main(["bench"]) == 2
    assert (
        "'bench' is not a command of mha-bench (run|report|compare|paired|tensorboard|race|kernels)"
        in capsys.readouterr().err
    )
    missing = str(tmp_path / "nope")
    assert cli.main(["report", missing]) == 2  # handed to the report's own main, which refuses it
    assert f"{missing!r} is not a directory" in capsys.readouterr().err


def test_the_main_job_takes_gpu_sized_shapes_on_cuda(harness_cli, tmp_path):
    """sweep=default's cuda_params replace its CPU shapes when the points run on CUDA (here asked
    with device=cuda:99, a GPU no machine has: every point is `unsupported`, at no cost, with or
    without CUDA; the real GPU-sized main job is `make gpu-check STEP=main`)."""
    from hydra_plugins.mha_bench.sweeper import on_cuda

    assert on_cuda("auto", ["device=cuda:0,cuda:1"]) and not on_cuda("auto", ["device=cpu"])
    assert on_cuda("cuda", []) and not on_cuda("cpu", ["seq_len=8"])
    proc = harness_cli(
        "sweep=default",
        "device=cuda:99",
        "check_only=true",
        "variant=fused",
        "hydra.sweep.dir=sweep",
    )
    df = pd.read_csv(tmp_path / "sweep" / "results.csv")
    assert sorted(set(df["seq_len"])) == [2048, 4096], proc.stderr[-2000:]
    assert set(df["batch"]) == {8}
    assert set(df["dtype"]) == {"bfloat16"} and set(df["head_dim"]) == {64}
    # the mission's questions at each GPU shape: attention x merge x compile for the fused way
    assert set(df["variant_options"]) == {
        f"attention={a} merge={m}" for a in ("manual", "sdpa", "flex") for m in ("view", "reshape")
    }
    assert set(df["compile"]) == {"off", "default"}
    assert len(df) == 2 * 2 * 12 and set(df["status"]) == {"unsupported"}
