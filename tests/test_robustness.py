"""Nothing lost: odd shapes, failures in their rows, SIGINT and SIGKILL, resume, launchers."""

import hashlib
import json
import re
import signal
import subprocess
import sys

import pandas as pd
import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.config import InvalidPoint
from harness.point import run_point
from harness.factory import make_point
from tests.conftest import TINY, WAYS, harness_env


def checked(name, **fields):
    """Check (no timing) one point of ``name`` on the CPU: conf defaults, tiny, with ``fields``."""
    fields = {"batch": 1, "seq_len": 4, "embed_dim": 8, "num_heads": 2, **fields}
    return run_point(make_point(name, device="cpu", check_only=True, **fields))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(WAYS),
    batch=st.integers(1, 3),
    seq_len=st.integers(1, 9),
    kv_seq_len=st.integers(1, 9),
    num_heads=st.integers(1, 4),
    head_dim=st.integers(1, 4),
    cross=st.booleans(),
    bias=st.booleans(),
    mask=st.sampled_from(["none", "causal", "padding"]),
    mode=st.sampled_from(["fwd", "fwd_bwd"]),
    attention=st.sampled_from(["manual", "sdpa"]),
    merge=st.sampled_from(["view", "reshape"]),
)
def test_odd_shapes_match_or_are_cleanly_refused(
    name, batch, seq_len, kv_seq_len, num_heads, head_dim, cross, bias, mask, mode, attention, merge
):
    toggles = {"attention": attention, "merge": merge} if name != "reference" else {}
    try:
        row = checked(
            name,
            batch=batch,
            seq_len=seq_len,
            kv_seq_len=kv_seq_len if cross else None,
            embed_dim=num_heads * head_dim,
            num_heads=num_heads,
            cross=cross,
            bias=bias,
            mask=mask,
            mode=mode,
            variant=toggles,
        )
    except InvalidPoint:
        return  # a clean refusal is allowed
    assert row["status"] in ("ok", "unsupported"), row


def test_head_dim_one_and_num_heads_equal_embed_dim():
    for name in WAYS:
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
        return out.masked_fill(
            torch.zeros_like(out, dtype=torch.bool).index_fill_(1, torch.tensor([0]), True),
            float("nan"),
        ), w


def test_impossible_shape_is_oom_and_the_rest_ok(harness_cli, tmp_path):
    # batch=64 x seq_len=1e6 x E=256: its float64 inputs alone are 131 GB, and
    # the memory estimate refuses it before anything is allocated (harness/way/footprint.py).
    proc = harness_cli(
        "-m",
        "batch=64",
        "seq_len=8,16,1000000",
        "check_only=true",
        "hydra.sweep.dir=sweep",
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    df = pd.read_csv(tmp_path / "sweep" / "results.csv").set_index("seq_len")
    assert df.loc[1000000, "status"] == "oom", df.loc[1000000, "error"]
    assert (
        "out of memory before allocating: needs at least" in df.loc[1000000, "error"]
    )  # refused, not tried
    assert df.loc[8, "status"] == "ok" and df.loc[16, "status"] == "ok"


def _start(tmp_path, *args):
    # SIGINT as a terminal gives it: a test run in the background of a script (`make test &`)
    # inherits SIGINT ignored, and Python then never installs its Ctrl-C handler.
    return subprocess.Popen(
        [sys.executable, "-m", "harness", *args],
        cwd=tmp_path,
        env=harness_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        bufsize=1,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def _signal_after(proc, sig, line_starts: str, times: int = 1) -> list[str]:
    """Read the sweep's output until a line starting with ``line_starts`` has appeared ``times``
    times, then send ``sig``: a progress line, not a clock, says where the sweep is."""
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if sum(x.startswith(line_starts) for x in lines) >= times:
            proc.send_signal(sig)
            return lines
    raise AssertionError(
        f"the sweep ended before '{line_starts}' (exit {proc.wait()}): {''.join(lines)[-2000:]}"
    )


def _journal(sweep) -> dict[str, list[dict]]:
    """The journal's samples by key, since each key's last reset."""
    out: dict[str, list[dict]] = {}
    for line in (sweep / "rounds.jsonl").read_text().splitlines():
        record = json.loads(line)
        out[record["key"]] = [] if record.get("reset") else [*out.get(record["key"], []), record]
    return out


# Points arrive one shape (seed) at a time; resident_mb=0 times each shape as its own block as
# soon as the next arrives (the default times them all after the last job), so that a kill can
# find a finished block, a block in its rounds and points not yet checked.
SHAPE = [a for a in TINY if not a.startswith("timing.round")]  # TINY less its rounds
BLOCKS = [
    "-m",
    "seed=0,1,2,3,4,5",
    "batch=1",
    "seq_len=8",
    "embed_dim=16",
    "num_heads=2",
    "timing.warmup=0",
    "timing.rounds=6",
    "timing.round_time=0.2",
    "timing.resident_mb=0",
    "num_threads=1",  # two threads stall each other on a busy machine (tests/conftest.py)
]


def _digests(sweep):
    return {
        p.parent.name: hashlib.sha1(p.read_bytes()).hexdigest() for p in sweep.glob("*/result.csv")
    }


@pytest.mark.slow  # 30 s: six blocks of rounds, a kill and a resume; make test-slow, CI
def test_sigkill_keeps_every_verdict_and_finished_round_and_resume_redoes_neither(
    harness_cli, tmp_path
):
    """SIGKILL in seed 1's rounds, then resume (about 20 s: six blocks of 0.2 s rounds, so that
    the kill lands inside a block's rounds on a machine of any speed)."""
    sweep = tmp_path / "sweep"
    proc = _start(tmp_path, *BLOCKS, f"hydra.sweep.dir={sweep}")
    _signal_after(proc, signal.SIGKILL, "round 3/6 done", times=2)  # seed 1's block, in its rounds
    proc.communicate()
    rows = {p.parent.name: pd.read_csv(p).iloc[0] for p in sweep.glob("*/result.csv")}
    assert rows["0"]["timing_state"] == "done"  # seed 0's block ended before the kill
    assert (
        rows["1"]["timing_state"] == "pending" and rows["1"]["check_passed"]
    )  # checked, in its rounds
    # seed 2 is checked only after seed 1's block has been timed (the budget is kept before a new
    # shape's check and capture: Pool.make_room), and seeds 3-5 never ran
    assert all(r["status"] == "ok" for r in rows.values()) and sorted(rows) == ["0", "1"]
    journal = _journal(sweep)
    seed1 = next(v for k, v in journal.items() if k.startswith("1:"))
    assert sorted(r["round"] for r in seed1)[:3] == [0, 1, 2]  # its three finished rounds
    finished = _digests(sweep)["0"]

    done = harness_cli(*BLOCKS, f"hydra.sweep.dir={sweep}", "resume=true")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("skipped") == 1  # seed 0
    assert done.stdout.count("check kept from the earlier run") == len(rows) - 1  # no check redone
    df = pd.read_csv(sweep / "results.csv").set_index("seed")
    assert sorted(df.index) == list(range(6)) and (df["status"] == "ok").all()
    assert (df["timing_state"] == "done").all()
    # every round (more where the shape was re-timed for a neighbour's spoiled round), unless a
    # busy machine spoiled some of its own (re-timed or left out)
    assert ((df["n_samples"] >= 6) | (df["contended_rounds"] > 0)).all()
    assert df.loc[1, "max_abs_err"] == rows["1"]["max_abs_err"]  # the same check, not a new one
    assert _digests(sweep)["0"] == finished  # a finished row is not rewritten
    # Seed 1's rounds before the kill are kept; only the missing ones ran (a repetition whose
    # reference had not run yet when the kill came has no pair and runs again).
    seed1_after = next(v for k, v in _journal(sweep).items() if k.startswith("1:"))
    assert seed1_after[: len(seed1)] == seed1
    before, after = {r["round"] for r in seed1}, [r["round"] for r in seed1_after[len(seed1) :]]
    assert {0, 1, 2} <= before and set(after) >= set(range(6)) - before
    # (rounds 6 and on re-time repetitions that a busy machine spoiled: not a redone round)
    redone = {r for r in set(after) - (set(range(6)) - before) if r < 6}
    assert redone <= {max(before)} and len(after) == len(set(after))


@pytest.mark.parametrize(
    "sig, code, said",
    [
        (signal.SIGINT, 130, "interrupted"),
        # as SIGINT, but its own word and exit code (16 s here): make test-slow
        pytest.param(signal.SIGTERM, 143, "terminated (SIGTERM)", marks=pytest.mark.slow),
        # the terminal closed (issue 58; the gallery has it at every moment): make test-slow
        pytest.param(signal.SIGHUP, 129, "hung up (SIGHUP)", marks=pytest.mark.slow),
    ],
)
def test_a_signal_in_the_rounds_keeps_partial_timing_rows_and_the_report(tmp_path, sig, code, said):
    sweep = tmp_path / "sweep"
    # 50 rounds: the sweep cannot end before the signal, sent once round 2 has ended.
    proc = _start(
        tmp_path,
        "-m",
        "seed=0,1",
        "variant=fused,reference",
        *SHAPE,
        "timing.rounds=50",
        "timing.round_time=0.02",
        f"hydra.sweep.dir={sweep}",
    )
    _signal_after(proc, sig, "round 2/50 done")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err[-2000:]
    assert said in err and "resume=true" in err
    df = pd.read_csv(sweep / "results.csv")
    assert len(df) == 4 and (df["status"] == "ok").all()
    # each timed in some of its rounds (on a busy machine a contended repetition is re-timed in a
    # later round, which the stop can come before: 1 clean one is possible), never all of them
    assert (df["timing_state"] == "partial").all() and df["n_samples"].between(1, 49).all()
    # an interval from the rounds it has; one round has none (NaN), not an invented one
    many = df["n_samples"] >= 2
    assert (df.loc[many, "latency_ms_ci_low"] < df.loc[many, "latency_ms_ci_high"]).all()
    assert df.loc[~many, ["latency_ms_ci_low", "latency_ms_ci_high"]].isna().all().all()
    assert df["latency_ms_median"].notna().all()
    assert "stopped before its timing ended" in out
    assert out.strip().splitlines()[-1].startswith("report: ")
    assert "stopped before its timing ended" in (sweep / "report.html").read_text()


@pytest.mark.parametrize(
    "sig, code",
    [
        (signal.SIGTERM, 143),
        # issue 58's other stops at this moment (about 20 s each): make test-slow, CI
        pytest.param(signal.SIGHUP, 129, marks=pytest.mark.slow),
        pytest.param(signal.SIGINT, 130, marks=pytest.mark.slow),
    ],
)
def test_a_stop_while_checking_keeps_a_row_for_every_checked_point(tmp_path, sig, code):
    sweep = tmp_path / "sweep"
    proc = _start(
        tmp_path,
        "-m",
        "seed=0,1,2,3,4,5,6,7",
        *SHAPE,
        "timing.rounds=50",
        f"hydra.sweep.dir={sweep}",
    )
    lines = _signal_after(proc, sig, "[2/8")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err[-2000:]
    checked = [x for x in lines + out.splitlines() if re.match(r"\[\d/8 .*\] ok ", x)]
    df = pd.read_csv(sweep / "results.csv")
    assert (
        len(df) == len(checked) >= 2 and (df["status"] == "ok").all()
    )  # every checked point, no other
    assert not (df["timing_state"] == "done").any()
    assert (sweep / "report.html").exists()  # gathered and reported before it exits


@pytest.mark.slow  # a second launcher's whole sweep (36 s here): make test-slow and CI run it
def test_submitit_local_gives_the_same_rows_as_the_basic_launcher(harness_cli, tmp_path):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    points = ["-m", "variant=fused,reference", *TINY]
    basic = harness_cli(*points, "hydra.sweep.dir=basic")
    local = harness_cli(
        *points, "hydra/launcher=submitit_local", "hydra.sweep.dir=local", timeout=600
    )
    assert basic.returncode == 0 and local.returncode == 0, local.stderr[-2000:]
    # device: on a CUDA machine submitit's local jobs ran on the CPU (CUDA_VISIBLE_DEVICES="")
    keys = ["variant", "seq_len", "dtype", "device", "status", "check_passed", "config_hash"]
    a = pd.read_csv(tmp_path / "basic" / "results.csv")[keys]
    b = pd.read_csv(tmp_path / "local" / "results.csv")[keys]
    pd.testing.assert_frame_equal(a, b)  # same points, same checks; only timings differ
    assert (tmp_path / "local" / "report.html").exists()


def test_slurm_launcher_config_composes_one_gpu_per_job(harness_cli):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    proc = harness_cli(
        "hydra/launcher=slurm_gpu",
        "hydra.launcher.partition=gpu",
        "hydra.launcher.account=acme",
        "--cfg",
        "hydra",
        "-p",
        "hydra.launcher",
    )
    assert proc.returncode == 0, proc.stderr
    cfg = yaml.safe_load(proc.stdout)
    assert (cfg["gpus_per_node"], cfg["partition"], cfg["account"]) == (1, "gpu", "acme")
    assert cfg["_target_"].endswith("SlurmLauncher") and cfg["timeout_min"] > 0


class LocalLauncher:  # named as submitit's: jobs_on_gpus goes by the class name
    def __init__(self, **params):
        self.params = params


class JoblibLauncher:
    def __init__(self, n_jobs):
        self.joblib = {"n_jobs": n_jobs}


def test_submitit_local_jobs_get_the_gpus_and_never_share_one():
    from hydra_plugins.mha_bench.sweeper import jobs_on_gpus

    one = LocalLauncher(gpus_per_node=0)
    assert jobs_on_gpus(one, 1, spread=False)[0] == 1 and one.params["gpus_per_node"] == 1
    eight = LocalLauncher()
    at_once, note = jobs_on_gpus(eight, 8, spread=False)
    assert (at_once, eight.params["gpus_per_node"]) == (1, 8)  # all see GPU 0: one at a time
    assert "gpu_for_job" in note
    assert jobs_on_gpus(LocalLauncher(), 8, spread=True)[0] == 8  # one per GPU at a time
    asked = LocalLauncher(gpus_per_node=2)
    assert jobs_on_gpus(asked, 8, spread=False) == (None, None)  # the user's choice stands
    assert jobs_on_gpus(LocalLauncher(), 0, spread=False) == (None, None)  # no GPU here
    assert "distort" in jobs_on_gpus(JoblibLauncher(4), 1, spread=False)[1]
    assert jobs_on_gpus(JoblibLauncher(4), 4, spread=True) == (None, None)


def test_auto_on_the_cpu_of_a_gpu_machine_warns_and_the_row_counts_the_hidden_gpus(
    tmp_path, monkeypatch, caplog
):
    """What submitit's local launcher did on the H100: CUDA_VISIBLE_DEVICES="" and device=auto
    quietly ran every job on the CPU. A fake driver directory with one GPU stands for that."""
    if torch.cuda.is_available():
        pytest.skip("torch sees a GPU here: auto is cuda")
    from harness import envinfo

    (tmp_path / "0000:04:00.0").mkdir()
    monkeypatch.setattr(envinfo, "DRIVER_GPUS", tmp_path)
    envinfo.driver_gpus.cache_clear()
    envinfo.warn_cpu_despite_gpus.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="harness"):
            assert envinfo.resolve_device("auto") == "cpu"
            assert envinfo.resolve_device("auto") == "cpu"
        warnings = [r.getMessage() for r in caplog.records if "device=auto" in r.getMessage()]
        assert len(warnings) == 1 and "1 GPU(s) that torch does not see" in warnings[0]
        assert envinfo.env_columns("cpu")["gpus_hidden"] == 1
    finally:
        envinfo.driver_gpus.cache_clear()
        envinfo.warn_cpu_despite_gpus.cache_clear()
    assert envinfo.env_columns("cpu")["gpus_hidden"] == envinfo.driver_gpus()


def test_cuda_n_becomes_the_current_device_and_a_missing_gpu_is_unsupported(monkeypatch):
    from harness.api import make_point
    from harness.envinfo import use_device
    from harness.point import admit

    chosen = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: chosen.append(device))
    use_device("cuda:1")
    use_device("cuda")  # the current device already
    use_device("cpu")
    assert chosen == [torch.device("cuda:1")]
    from harness.envinfo import environment

    environment()  # the machine's facts, read (and cached) before CUDA is faked
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    why = admit(make_point("fused", device="cuda:3"))[0].refused
    assert "device='cuda:3' but torch sees 1 GPU(s)" in why


def test_a_sigterm_that_lands_in_a_weakref_callback_still_stops_the_run():
    """Python ignores an exception raised in a weakref callback or ``__del__`` (torch frees
    tensors that way): a SIGTERM handled there would be lost and the sweep would run on to exit
    0. It is sent again and stops the ordinary code that follows."""
    code = """
import os, signal, sys, time, weakref
from harness.errors import Terminated
from harness.sweep.signals import stop_on_sigterm
stop_on_sigterm()
class Freed:
    pass
def callback(_):
    os.kill(os.getpid(), signal.SIGTERM)  # handled while this callback runs
    sum(range(10**6))
try:
    obj = Freed()
    ref = weakref.ref(obj, callback)
    del obj
    for _ in range(200):
        time.sleep(0.01)
except Terminated:
    sys.exit(143)
sys.exit(0)
"""
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env=harness_env(),
    )
    assert proc.returncode == 143, proc.stderr[-2000:]


@pytest.mark.slow  # a kill and a resume (about 15 s): make test-slow and CI run it
def test_sigkill_while_checking_then_resume_ends_with_every_row_once(tmp_path):
    """Issue 58's gallery, SIGKILL at the checks' moment: nothing is gathered (the process is
    gone), the checked points' rows are on disk, and resume=true checks only the rest and ends
    with every row, each once."""
    sweep = tmp_path / "sweep"
    points = ["-m", "seed=0,1,2,3,4,5", "check_only=true", *SHAPE, f"hydra.sweep.dir={sweep}"]
    proc = _start(tmp_path, *points)
    _signal_after(proc, signal.SIGKILL, "[2/6")
    proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL
    kept = {p.parent.name for p in sweep.glob("*/result.csv")}
    assert len(kept) >= 2 and not (sweep / "results.csv").exists()
    done = subprocess.run(
        [sys.executable, "-m", "harness", *points, "resume=true"],
        cwd=tmp_path, env=harness_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("skipped") == len(kept)  # not checked again
    df = pd.read_csv(sweep / "results.csv")
    assert sorted(df["seed"]) == list(range(6)) and (df["status"] == "ok").all()
