"""Profiler traces end to end: a real profiled sweep, a real TensorBoard with torch-tb-profiler
on a loopback port, checked over HTTP. No mocks."""

import gzip
import json
import urllib.parse
import urllib.request

import pandas as pd
import pytest

from harness.report import tensorboard
from harness.point import run_point
from harness.measure.profiling import SUMMARY_FILE
from harness.factory import make_point
from tests.conftest import TINY


def get(base: str, route: str, **params):
    query = urllib.parse.urlencode(params)
    with urllib.request.urlopen(
        f"{base}/data/plugin/pytorch_profiler/{route}?{query}", timeout=30
    ) as r:
        return json.loads(r.read())


@pytest.fixture
def profiled_sweep(harness_cli, tmp_path):
    proc = harness_cli(
        "-m",
        "profile=true",
        "variant=fused",
        "variant.merge=view,reshape",
        "variant.attention=manual",
        *TINY,
        "hydra.sweep.dir=sweep",
    )
    assert proc.returncode == 0, proc.stderr
    (tmp_path / "console.txt").write_text(proc.stdout)
    return tmp_path / "sweep"


def test_profiled_sweep_writes_one_trace_dir_per_point_with_summary(profiled_sweep):
    df = pd.read_csv(profiled_sweep / "results.csv")
    assert len(df) == 2 and (df["status"] == "ok").all()
    assert df["latency_ms_median"].notna().all()  # profiling comes after timing, not instead
    for row in df.to_dict("records"):
        point_dir = profiled_sweep / row["trace_dir"]
        traces = list(point_dir.glob("*.pt.trace.json"))
        assert len(traces) == 1
        trace = json.loads(traces[0].read_text())  # Chrome trace JSON: what Perfetto opens
        assert trace["traceEvents"] and all("ph" in e for e in trace["traceEvents"][:50])
        summary = pd.read_csv(point_dir / SUMMARY_FILE)
        assert {"op", "calls_per_call", "self_cpu_us_per_call"} <= set(summary.columns)
        assert "aten::bmm" in set(summary["op"])  # manual attention: two batched matmuls
        assert row["ops_per_call"] > 0 and row["copies_per_call"] >= 1  # the head merge copies
        assert "aten::" in row["top_ops"]
    assert sorted(p.name[:3] for p in (profiled_sweep / "traces").iterdir()) == ["000", "001"]
    # the console says where they went and what opens them (issue 57), before the report's line
    lines = (profiled_sweep.parent / "console.txt").read_text().strip().splitlines()
    said = [line for line in lines if line.startswith("traces: ")]
    assert said == ["traces: sweep/traces (2 points): mha-bench tensorboard sweep"]  # as given
    assert lines[-1].startswith("report: ")


def test_the_tensorboard_command_is_quoted_for_a_shell():
    """A directory named with shell syntax stays a name when the printed command is pasted."""
    assert (
        tensorboard.command("runs/x$(touch PWNED)")
        == "mha-bench tensorboard 'runs/x$(touch PWNED)'"
    )
    assert tensorboard.command("runs/plain") == "mha-bench tensorboard runs/plain"


def test_tensorboard_serves_one_run_per_point(profiled_sweep):
    logdir = tensorboard.trace_root(profiled_sweep)
    proc, base = tensorboard.start(logdir)
    try:
        runs = tensorboard.wait_ready(proc, base, n_runs=2, timeout=180)
        df = pd.read_csv(profiled_sweep / "results.csv")
        assert sorted(runs) == sorted(p.split("/", 1)[1] for p in df["trace_dir"])
        for run in runs:
            views = get(base, "views", run=run)
            assert "Overview" in views and "Operator" in views
            worker = get(base, "workers", run=run, view="Overview")[0]
            span = get(base, "spans", run=run, worker=worker)[0]
            overview = get(base, "overview", run=run, worker=worker, span=span)
            assert overview["steps"]["rows"], overview.keys()
            table = get(
                base, "operation/table", run=run, worker=worker, span=span, group_by="Operation"
            )
            names = {op["name"] for op in table["data"]}
            assert {"aten::bmm", "aten::softmax"} & names and all(
                op["calls"] > 0 for op in table["data"]
            )
            query = urllib.parse.urlencode(dict(run=run, worker=worker, span=span))
            with urllib.request.urlopen(
                f"{base}/data/plugin/pytorch_profiler/trace?{query}", timeout=30
            ) as r:
                body = r.read()
                if r.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
            assert json.loads(body)["traceEvents"]  # the Trace view's data
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_tensorboard_cli_refuses_a_dir_without_traces(tmp_path, capsys):
    assert tensorboard.main([str(tmp_path)]) == 2
    assert "profile=true" in capsys.readouterr().err


def test_a_profiling_failure_keeps_the_timing_row(tmp_path):
    point = make_point(
        "fused",
        batch=1,
        seq_len=8,
        embed_dim=16,
        num_heads=2,
        device="cpu",
        profile=True,
        timing=dict(warmup=0.001, rounds=3, round_time=0.001),
    )
    blocker = tmp_path / "traces"
    blocker.write_text("a file where the trace dir should go")
    row = run_point(point, trace_root=blocker)
    assert row["status"] == "ok" and row["latency_ms_median"] > 0
    assert row["profile_error"] and row["trace_dir"] is None


@pytest.mark.parametrize("repeat", [2, 3])
def test_per_call_counts_are_the_same_for_any_number_of_cycles(tmp_path, repeat):
    """After the profile only the last cycle's events remain: counts over all cycles' calls came
    out halved at repeat=2."""
    import torch

    from harness.config import ProfilerOptions
    from harness.measure.profiling import run_profile

    a = torch.randn(16, 16)

    def call():  # 1 mm and 1 copy per call
        return (a @ a).t().contiguous()

    def profiled(n, name):
        opts = ProfilerOptions(wait=0, warmup=1, active=2, repeat=n)
        return run_profile(call, None, "cpu", tmp_path / name, name, opts)

    one, many = profiled(1, "one"), profiled(repeat, "many")
    assert many.copies_per_call == one.copies_per_call == 1
    assert many.ops_per_call == one.ops_per_call
    assert "aten::mm x1" in many.top_ops
    assert len(list((tmp_path / "many").glob("*.pt.trace.json"))) == repeat  # a trace per cycle


@pytest.mark.slow  # a profiled sweep and a TensorBoard start (about 30 s): make test-slow
def test_tensorboard_comes_up_behind_a_proxy_and_goes_with_a_sigterm(profiled_sweep):
    """Issue 58: with http_proxy set and no no_proxy, the readiness polls went to the proxy and
    the command failed after 120 s though TensorBoard was up; SIGTERM to the command left
    TensorBoard running and listening."""
    import os
    import signal
    import socket
    import subprocess
    import sys
    import time

    from tests.conftest import harness_env

    env = {**harness_env(), "http_proxy": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9"}
    env.pop("no_proxy", None), env.pop("NO_PROXY", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "harness.report.tensorboard", str(profiled_sweep)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        lines = [proc.stdout.readline() for _ in range(2)]
        assert lines[1].startswith("open: http://127.0.0.1:"), (lines, proc.stderr.read())
        port = int(lines[1].split("127.0.0.1:")[1].split("/")[0])
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 143
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # TensorBoard gone: nothing listens on its port
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) != 0:
                    break
            time.sleep(0.5)
        else:
            raise AssertionError(f"TensorBoard still listens on {port} after its command ended")
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
