"""Failure handling part by part: crash messages, drop-in problems, the memory estimate, the
leak rule, timing keys, resume and gather, file modes, the check gate, the job's visits."""

import json
import os
import signal
import subprocess
import sys
import time

import pandas as pd
import pytest
import torch

from tests.conftest import REPO, harness_env
from harness.way import checks  # noqa: E402
from harness.sweep.callbacks import check_summary  # noqa: E402
from harness.config import InvalidPoint  # noqa: E402
from harness.errors import classify  # noqa: E402
from harness.way.footprint import TooLarge, check_fits, estimate, scores_of  # noqa: E402
from harness.way.inputs import make_inputs  # noqa: E402
from harness.results import JOBS_FILE, gather, write_row
from harness.files import atomic_write_text
from harness.measure.journal import Sample  # noqa: E402
from harness.measure.rounds import Session  # noqa: E402
from harness.factory import make_point  # noqa: E402
from harness.sweep.resume import resume_state  # noqa: E402
from harness.sweep.worker import crash_message  # noqa: E402


FAULTY = REPO / "tests" / "faulty"
SMALL = dict(batch=1, seq_len=8, embed_dim=16, num_heads=2, device="cpu")


def test_crash_messages_name_the_signal_or_the_code():
    assert "likely out of memory" in crash_message(-signal.SIGKILL)
    assert "SIGABRT" in crash_message(-signal.SIGABRT) and "SIGSEGV" in crash_message(
        -signal.SIGSEGV
    )
    assert "exited with code 3" in crash_message(3)
    assert "SIGTERM" in crash_message(-signal.SIGTERM)


def test_drop_in_problems_are_named_and_clean_outputs_have_none():
    ref = {"out": torch.zeros(1, 2, 4), "attn_weights": torch.zeros(1, 2, 2)}
    assert checks.drop_in(dict(ref), ref, []) == []
    got = {
        "out": torch.zeros(1, 2, 4, dtype=torch.float64),
        "attn_weights": torch.zeros(1, 2, 2, device="meta"),
    }
    assert checks.drop_in(got, ref, ["key_padding_mask"]) == [
        "out dtype float64, expected float32",
        "attn_weights device meta, expected cpu",
        "key_padding_mask modified in place",
    ]


def test_inputs_report_exactly_the_tensors_changed_in_place():
    inputs = make_inputs(make_point("fused", **SMALL, cross=True, mask="padding"))
    given = inputs.given()
    assert inputs.changed(given) == []
    inputs.value.add_(1)
    inputs.kwargs["key_padding_mask"][0, 0] = ~inputs.kwargs["key_padding_mask"][0, 0]
    assert inputs.changed(given) == ["value", "key_padding_mask"]


def test_a_point_that_cannot_fit_is_oom_with_its_estimate_before_allocating():
    huge = make_point("fused", **{**SMALL, "seq_len": 10_000_000, "embed_dim": 256, "num_heads": 4})
    with pytest.raises(TooLarge, match=r"needs at least [\d.e+]+ GiB on cpu") as e:
        check_fits(huge, scores_of(huge))
    assert classify(e.value) == "oom"
    small = make_point("fused", **SMALL)
    assert 0 < check_fits(small, scores_of(small)) < 2**20
    # the L x S scores count where the path materialises them, and fwd_bwd triples what it keeps
    manual = make_point("fused", **SMALL, variant={"attention": "manual"})
    assert estimate(manual, scores_of(manual))["cpu"] > estimate(small, scores_of(small))["cpu"]
    long = {**SMALL, "seq_len": 512}  # activations dominate the weights
    assert (
        estimate(make_point("fused", **long, mode="fwd_bwd"), False)["cpu"]
        > 2 * estimate(make_point("fused", **long), False)["cpu"]
    )


def _session(growth, confirmed=None):
    s = Session(make_point("fused", **SMALL), call=lambda: None, before=None, nbytes=0, finish=None)
    s.samples = [Sample(r, float(r), 1.0, "run", int(g * 2**20)) for r, g in enumerate(growth)]
    s.leak_confirmed = confirmed
    return s


def test_leak_is_steady_growth_confirmed_by_a_second_measurement():
    assert _session([0.5] * 8, confirmed=True).leak_columns()["leak"] is True
    assert (
        _session([0.5] * 8, confirmed=False).leak_columns()["leak"] is False
    )  # did not grow again
    assert _session([0.5] * 8).leak_columns() == {
        "mem_growth_mb": 4.0,
        "leak": None,
    }  # rounds cut short: unknown
    assert _session([4.0, 0, 0, 0, 0, 0, 0, 0]).grew_steadily() is False  # one arena, once
    assert _session([0.01] * 8).grew_steadily() is False  # below LEAK_MB in all
    assert _session([0.5, -0.5] * 4).leak_columns() == {"mem_growth_mb": 0.0, "leak": False}


def test_the_second_measurement_confirms_a_real_leak_and_clears_one_that_stopped_growing():
    kept = []
    leaky = _session([0.5] * 8)
    leaky.calls, leaky.warm = 1, False
    leaky.call = lambda: kept.append(
        torch.ones(2**20 // 4 * 3 // 4)
    )  # 0.75 MiB a call: the rounds' pace
    assert leaky.confirm_leak() is True and leaky.leak_columns()["leak"] is True
    cache = {}
    settled = _session([0.5] * 8)  # grew in the rounds (a cache filling), not any more
    settled.calls, settled.warm = 1, False
    settled.call = lambda: cache.setdefault("x", torch.ones(2**20))
    settled.call()
    assert settled.confirm_leak() is False and settled.leak_columns()["leak"] is False


def test_timing_keys_are_checked_against_each_other():
    import math

    from harness.config import rerun_floor

    least = math.sinh(1.959964 * rerun_floor("cpu")[0])  # the earned floor's half-width
    with pytest.raises(InvalidPoint, match="can never be met"):
        make_point("fused", **SMALL, timing={"max_noise": round(least * 0.9, 4)})
    with pytest.raises(InvalidPoint, match="can never be met"):
        make_point("fused", **SMALL, timing={"max_noise": 0.07, "rerun_noise": 0.04})
    # fine: floor 3.9%
    make_point("fused", **SMALL, timing={"max_noise": 0.07, "rerun_noise": 0.02})


@pytest.mark.parametrize("rounds", [1, 0, True, 2.5])
def test_fewer_than_two_rounds_is_refused_in_one_line(rounds):
    with pytest.raises(
        InvalidPoint,
        match=rf"^timing.rounds={rounds!r} must be an integer >= 2 \(an interval needs",
    ):
        make_point("fused", **SMALL, timing={"rounds": rounds})
    assert make_point("fused", **SMALL, timing={"rounds": 2}).timing.rounds == 2


def test_subprocesses_add_to_the_callers_pythonpath_never_replace_it(tmp_path, monkeypatch):
    """Where the dependencies come in through PYTHONPATH (a bare GPU image), a test's or a
    script's harness subprocess with a path of its own must still import them."""
    dep = tmp_path / "deps"
    dep.mkdir()
    (dep / "brought_in.py").write_text("WHERE = 'deps'\n")
    monkeypatch.setenv("PYTHONPATH", str(dep))
    env = harness_env(FAULTY)
    assert env["PYTHONPATH"].split(os.pathsep) == [str(FAULTY), str(REPO), str(dep)]
    proc = subprocess.run(
        [sys.executable, "-c", "import brought_in, faults, harness; print(brought_in.WHERE)"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "deps", proc.stderr[-2000:]


def test_point_timeout_must_be_positive_or_null():
    assert make_point("fused", **SMALL, point_timeout=None).point_timeout is None
    with pytest.raises(InvalidPoint, match=r"point_timeout=0 must be a number of seconds > 0"):
        make_point("fused", **SMALL, point_timeout=0)


def test_unknown_key_in_a_point_is_refused_with_a_suggestion():
    with pytest.raises(
        InvalidPoint, match=r"seq_lenn=5 is not a config key \(did you mean seq_len\?\)"
    ):
        make_point("fused", **SMALL, seq_lenn=5)


def test_resume_reruns_failed_and_damaged_rows_and_continues_unfinished_timing(tmp_path):
    rows = {
        "crashed": {"status": "crashed"},
        "timeout": {"status": "timeout"},
        "mismatch": {"status": "mismatch"},
        "ok": {"status": "ok", "latency_ms_median": 1.0, "timing_state": "done"},
        "before_timing_state": {
            "status": "ok",
            "latency_ms_median": 1.0,
        },  # a row written before the column
        "pending": {"status": "ok", "timing_state": "pending", "max_abs_err": 1e-7},
        "partial": {
            "status": "ok",
            "timing_state": "partial",
            "latency_ms_median": 1.0,
            "n_samples": 3,
        },
    }
    for name, row in rows.items():
        write_row(tmp_path / name, {**row, "config_hash": "h"})
    states = {name: resume_state(tmp_path / name, "h", True) for name in rows}
    assert {n: s for n, (s, _) in states.items()} == {
        "crashed": "run",
        "timeout": "run",
        "mismatch": "run",
        "ok": "done",
        "before_timing_state": "done",
        "pending": "continue",
        "partial": "continue",
    }
    assert (
        states["pending"][1]["max_abs_err"] == 1e-7
        and states["pending"][1]["latency_ms_median"] is None
    )
    assert resume_state(tmp_path / "pending", "other", True)[0] == "run"  # another configuration
    assert (
        resume_state(tmp_path / "pending", "h", False)[0] == "done"
    )  # check_only: the check is all it needs
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "result.csv").write_bytes(b"\xff\xfe\x81")
    assert resume_state(tmp_path / "bad", "h", True) == ("run", None)


def test_gather_takes_the_listed_jobs_with_their_hashes_and_names_damaged_rows(tmp_path):
    for job, h in (("0", "a"), ("1", "b"), ("2", "c"), ("9", "old")):
        write_row(tmp_path / job, {"status": "ok", "config_hash": h, "seed": int(job)})
    (tmp_path / "3").mkdir()
    (tmp_path / "3" / "result.csv").write_text("garbage\x00,\n1,2,3\n")
    listing = [
        {"dir": "0", "config_hash": "a"},
        {"dir": "1", "config_hash": "changed"},
        {"dir": "2", "config_hash": "c"},
        {"dir": "3", "config_hash": "d"},
    ]
    atomic_write_text(tmp_path / JOBS_FILE, json.dumps({"jobs": listing}))
    problems = []
    df = gather(tmp_path, problems)
    assert df["seed"].tolist() == [
        0,
        2,
    ]  # job 9 is not this sweep's; job 1's row is another config's
    assert (
        len(problems) == 2
        and "config hash differs" in problems[0]
        and "3/result.csv" in problems[1]
    )


def test_files_get_the_usual_modes(tmp_path):
    path = write_row(tmp_path, {"status": "ok"})
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask


def test_check_gate_needs_a_checked_point_and_no_failure():
    frame = lambda *statuses: pd.DataFrame({"status": list(statuses)})  # noqa: E731
    assert check_summary(frame("ok", "unsupported"))[1] is True
    assert check_summary(frame("unsupported", "oom", "unsupported"))[1] is False
    assert check_summary(frame("ok", "crashed"))[1] is False
    assert check_summary(frame("ok", "timeout"))[1] is False
    assert check_summary(frame())[1] is False
    assert check_summary(frame("ok", "mismatch", "unsupported"))[0].startswith(
        "checked 2 (1 passed, 1 failed), unsupported 1"
    )


def test_an_unexpected_failure_at_the_end_is_an_error_line_and_exit_3_not_a_warning(capsys):
    from harness.sweep.callbacks import _guarded

    def finish():
        raise TypeError("'<' not supported")

    with pytest.raises(SystemExit) as e:
        _guarded(finish, 3)
    assert e.value.code == 3
    assert capsys.readouterr().err.strip() == "error: finish failed: TypeError: '<' not supported"


def test_the_job_process_reads_a_backlog_of_visits_in_one_go():
    """Visits queue up while the job process naps; it must then read them all, not one per nap:
    at one per nap the socket filled during a long sweep's rounds and the worker blocked in
    send() between its repetitions (a minute every third round)."""
    import socket
    from multiprocessing.connection import Connection

    from harness.sweep.worker import VISIT_NAP_S, Worker

    ours, theirs = socket.socketpair()
    job, worker = Worker(), Connection(theirs.detach())
    job.conn = Connection(ours.detach())
    for r in range(200):
        worker.send(("visit", None, r))
    worker.send(("idle",))
    t0 = time.perf_counter()
    assert job._wait(lambda msg: msg[0] == "idle") == ("idle",)
    assert time.perf_counter() - t0 < 20 * VISIT_NAP_S  # one nap per visit: 200 naps, 50 s


def test_the_private_hydra_api_the_sweeper_relies_on_is_there():
    """hydra_plugins/mha_bench/sweeper.py subclasses hydra._internal's BasicSweeper (no public base
    does what it needs) and pyproject pins hydra-core below 1.4: a Hydra that moves what the
    sweeper relies on fails here, by name, rather than in the middle of a sweep."""
    import inspect

    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    from hydra_plugins.mha_bench.sweeper import HarnessSweeper

    assert issubclass(HarnessSweeper, BasicSweeper)
    assert isinstance(inspect.getattr_static(BasicSweeper, "split_arguments"), staticmethod)
    assert list(inspect.signature(BasicSweeper.split_arguments).parameters) == [
        "overrides",
        "max_batch_size",
    ]
    source = inspect.getsource(BasicSweeper)
    relied_on = [
        "self.batch_index",
        "self.overrides",
        "self.config",
        "self.launcher",
        "self.hydra_context",
        "self.validate_batch_is_legal(",
        "self.split_arguments(",
    ]
    assert [name for name in relied_on if name not in source] == []
    from hydra.core.config_loader import ConfigLoader

    # the sweeper composes one job per set of group choices, and asks which keys are groups
    assert callable(ConfigLoader.load_sweep_config) and callable(ConfigLoader.get_group_options)


@pytest.mark.parametrize("model, copies", [({"position_bias": "alibi"}, 1), ({"sinks": True}, 2)])
def test_the_estimate_counts_the_mask_nn_mha_is_handed(model, copies):
    """nn.MHA takes ALiBi and sinks in a float (B*H, L, S) mask (and for sinks add_zero_attn's
    padded copy): 4.3 GB each in bfloat16 at L=8192, H=32, which the lower bound left out."""
    from harness.way.calls import for_module
    from harness.way.footprint import handed_elements
    from harness.way.inputs import make_reference

    shape = {**SMALL, "batch": 2, "seq_len": 16, "mask": "causal"}
    point, plain = make_point("fused", **shape, **model), make_point("fused", **shape)
    handed = for_module(make_inputs(point), make_reference(point)).kwargs["attn_mask"]
    assert handed.shape == (2 * 2, 16, 16)  # (B*H, L, S): what nn.MHA holds
    assert handed_elements(point) == copies * handed.numel() and handed_elements(plain) == 0
    grown = estimate(point, scores_of(point))["cpu"] - estimate(plain, scores_of(plain))["cpu"]
    assert grown == 4 * copies * handed.numel()


def test_a_stop_hidden_under_a_librarys_cleanup_error_is_still_the_stop():
    """Ctrl-C while Hydra read a config file: its ``finally`` closed a file it never opened, and
    the sweep ended in an UnboundLocalError's traceback, exit 1 (CI, the operator gallery's
    SIGINT at the checks). The stop is in the error's context: it is found there."""
    from harness.errors import Terminated, stop_within

    def library():
        try:
            raise Terminated()  # the signal, landing inside the library's try
        finally:
            raise UnboundLocalError("cannot access local variable 'f'")  # its cleanup

    with pytest.raises(UnboundLocalError) as e:
        library()
    assert isinstance(stop_within(e.value), Terminated)
    assert stop_within(ValueError("no stop")) is None and stop_within(None) is None
    wrapped = RuntimeError("outer")
    wrapped.__cause__ = KeyboardInterrupt()
    assert isinstance(stop_within(wrapped), KeyboardInterrupt)
