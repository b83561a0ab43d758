"""Nothing lost: odd shapes, failures in their rows, SIGINT and SIGKILL, resume, launchers."""

import hashlib
import signal
import subprocess
import sys
import time

import pandas as pd
import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.config import InvalidPoint
from harness.point import run_point
from harness.sweep.run import point_for
from tests.conftest import TINY, VARIANT_NAMES, harness_env


def checked(name, **fields):
    """Check (no timing) one point of ``name`` on the CPU: conf defaults, tiny, with ``fields``."""
    fields = {"batch": 1, "seq_len": 4, "embed_dim": 8, "num_heads": 2, **fields}
    return run_point(point_for(name, device="cpu", check_only=True, **fields))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(VARIANT_NAMES),
    batch=st.integers(1, 3), seq_len=st.integers(1, 9), kv_seq_len=st.integers(1, 9),
    num_heads=st.integers(1, 4), head_dim=st.integers(1, 4),
    cross=st.booleans(), bias=st.booleans(),
    mask=st.sampled_from(["none", "causal", "padding"]), mode=st.sampled_from(["fwd", "fwd_bwd"]),
    attention=st.sampled_from(["manual", "sdpa"]), merge=st.sampled_from(["view", "reshape"]),
)
def test_odd_shapes_match_or_are_cleanly_refused(name, batch, seq_len, kv_seq_len, num_heads, head_dim, cross,
                                                 bias, mask, mode, attention, merge):
    toggles = {"attention": attention, "merge": merge} if name != "reference" else {}
    try:
        row = checked(name, batch=batch, seq_len=seq_len, kv_seq_len=kv_seq_len if cross else None,
                      embed_dim=num_heads * head_dim, num_heads=num_heads, cross=cross, bias=bias, mask=mask,
                      mode=mode, variant=toggles)
    except InvalidPoint:
        return  # a clean refusal is allowed
    assert row["status"] in ("ok", "unsupported"), row


def test_head_dim_one_and_num_heads_equal_embed_dim():
    for name in VARIANT_NAMES:
        row = checked(name, embed_dim=4, num_heads=4, seq_len=1, mode="fwd_bwd")
        assert row["status"] == "ok", row


def test_nan_in_an_output_is_a_mismatch_with_that_reason():
    row = checked("fused", variant={"_target_": "tests.test_robustness.NaNOut"})
    assert row["status"] == "mismatch" and "NaN/Inf" in row["error"], row


class NaNOut(torch.nn.MultiheadAttention):
    def __init__(self, embed_dim, num_heads, bias=True):
        super().__init__(embed_dim, num_heads, bias=bias, batch_first=True)

    def forward(self, *args, **kwargs):
        out, w = super().forward(*args, **kwargs)
        return out.masked_fill(torch.zeros_like(out, dtype=torch.bool).index_fill_(1, torch.tensor([0]), True),
                               float("nan")), w


def test_impossible_shape_is_oom_and_the_rest_ok(harness_cli, tmp_path):
    # The example: batch=64 x seq_len=1e6 x E=256. Its float64 inputs alone are 131 GB:
    # the memory estimate refuses it before anything is allocated (harness/measure/footprint.py).
    proc = harness_cli("-m", "batch=64", "seq_len=8,16,1000000", "check_only=true",
                       "hydra.sweep.dir=sweep", timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    df = pd.read_csv(tmp_path / "sweep" / "results.csv").set_index("seq_len")
    assert df.loc[1000000, "status"] == "oom", df.loc[1000000, "error"]
    assert "out of memory before allocating: needs at least" in df.loc[1000000, "error"]  # refused, not tried
    assert df.loc[8, "status"] == "ok" and df.loc[16, "status"] == "ok"


def _start(tmp_path, *args):
    return subprocess.Popen([sys.executable, "-m", "harness", *args], cwd=tmp_path, env=harness_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_rows(sweep, n, proc, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if len(list(sweep.glob("*/result.csv"))) >= n:
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    raise TimeoutError(f"fewer than {n} rows after {timeout} s")


# resident_mb=0: every shape (here: seed) is timed as its own block as soon as the next one
# arrives, so rows land one by one while the sweep runs (the default times them all at the end).
SLOW_SWEEP = ["-m", "seed=0,1,2,3,4,5,6,7", "batch=1", "seq_len=8", "embed_dim=16", "num_heads=2",
              "timing.warmup=0", "timing.rounds=5", "timing.round_time=0.1", "timing.resident_mb=0"]


def _digests(sweep):
    return {p.parent.name: hashlib.sha1(p.read_bytes()).hexdigest() for p in sweep.glob("*/result.csv")}


def test_sigkill_then_resume_keeps_every_row_once_and_untouched(harness_cli, tmp_path):
    sweep = tmp_path / "sweep"
    proc = _start(tmp_path, *SLOW_SWEEP, f"hydra.sweep.dir={sweep}")
    _wait_for_rows(sweep, 2, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    first = _digests(sweep)
    assert 2 <= len(first) < 8
    for path in sweep.glob("*/result.csv"):
        assert len(pd.read_csv(path)) == 1  # every finished row intact and readable
    done = harness_cli(*SLOW_SWEEP, f"hydra.sweep.dir={sweep}", "resume=true")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("skipped") == len(first)
    df = pd.read_csv(sweep / "results.csv")
    assert sorted(df["seed"]) == list(range(8)) and (df["status"] == "ok").all()
    after = _digests(sweep)
    assert all(after[job] == digest for job, digest in first.items())  # not rewritten


def test_sigint_ends_cleanly_with_results_and_report(tmp_path):
    sweep = tmp_path / "sweep"
    proc = _start(tmp_path, *SLOW_SWEEP, f"hydra.sweep.dir={sweep}")
    _wait_for_rows(sweep, 2, proc)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert "interrupted" in err
    df = pd.read_csv(sweep / "results.csv")
    assert 2 <= len(df) < 8 and (df["status"] == "ok").all()
    assert out.strip().splitlines()[-1].startswith("report: ")


def test_submitit_local_gives_the_same_rows_as_the_basic_launcher(harness_cli, tmp_path):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    points = ["-m", "variant=fused,reference", *TINY]
    basic = harness_cli(*points, "hydra.sweep.dir=basic")
    local = harness_cli(*points, "hydra/launcher=submitit_local", "hydra.sweep.dir=local", timeout=600)
    assert basic.returncode == 0 and local.returncode == 0, local.stderr[-2000:]
    keys = ["variant", "seq_len", "dtype", "status", "check_passed", "max_abs_err", "config_hash"]
    a = pd.read_csv(tmp_path / "basic" / "results.csv")[keys]
    b = pd.read_csv(tmp_path / "local" / "results.csv")[keys]
    pd.testing.assert_frame_equal(a, b)  # same points, same checks; only timings differ
    assert (tmp_path / "local" / "report.html").exists()


def test_slurm_launcher_config_composes_one_gpu_per_job(harness_cli):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    proc = harness_cli("hydra/launcher=slurm_gpu", "hydra.launcher.partition=gpu", "hydra.launcher.account=acme",
                       "--cfg", "hydra", "-p", "hydra.launcher")
    assert proc.returncode == 0, proc.stderr
    cfg = yaml.safe_load(proc.stdout)
    assert (cfg["gpus_per_node"], cfg["partition"], cfg["account"]) == (1, "gpu", "acme")
    assert cfg["_target_"].endswith("SlurmLauncher") and cfg["timeout_min"] > 0
