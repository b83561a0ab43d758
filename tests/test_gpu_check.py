"""`make gpu-check` (scripts/gpu_check.py) without a GPU: its one-line refusal, its targets from
made-up figures, and the files it leaves (docs/measurements.md, "On a GPU")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
import gpu_check  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_it_refuses_in_one_line_and_exits_2():
    proc = subprocess.run(
        [sys.executable, "scripts/gpu_check.py", "--steps", "timer"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert len(lines) == 1 and "no CUDA device here" in lines[0]


def test_an_unknown_step_is_named_in_one_line(capsys):
    assert gpu_check.main(["--steps", "timer,warp"]) == 2
    out = capsys.readouterr().out.strip().splitlines()
    assert out == [
        "gpu-check: unknown step 'warp'; steps are "
        + ", ".join(gpu_check.STEPS)
        + " (llm: llm_prefill, llm_window, llm_decode)"
    ]


def test_steps_run_probe_timer_main_stability_first_each_within_six_minutes():
    assert gpu_check.STEPS[:4] == ("probe", "timer", "main", "stability")
    assert set(gpu_check.LIMIT_S) == set(gpu_check.STEPS)
    assert max(gpu_check.LIMIT_S.values()) <= 360 and gpu_check.LIMIT_S["probe"] <= 240
    # llm is its three sweeps, in order; a step named twice runs once
    assert gpu_check.chosen_steps("llm") == (["llm_prefill", "llm_window", "llm_decode"], None)
    assert gpu_check.chosen_steps("timer,llm_window,llm")[0] == [
        "timer",
        "llm_window",
        "llm_prefill",
        "llm_decode",
    ]
    assert gpu_check.chosen_steps("timer,warp") == ([], "warp")


def probe_figures(
    held=(900.0, 1900.0), first=None, second=None, launch_bound=True, block_mb=1950.0
):
    import gpu_probe

    fig = dict(
        pool=[
            dict(point=f"p{i}", status="ok", estimate_mb=2000.0, held_mb=h)
            for i, h in enumerate(held)
        ],
        capture=[
            first
            or dict(label="reads", status="ok", timed_by="events", graph_error="not captured: E"),
            second or dict(label="fused", status="ok", timed_by="graph", graph_error=None),
        ],
        decode=dict(
            status="ok",
            eager_ms_median=0.05,
            latency_ms_median=0.05,
            replay_warm_ms_median=0.03,
            launch_bound=launch_bound,
        ),
    )
    fig["block"] = dict(statuses=["ok"] * len(held), held_mb=block_mb, reserved_mb=block_mb)
    fig["misses"] = gpu_probe.held(fig)
    return fig


def test_probe_targets_hold_the_pool_estimate_the_capture_and_the_decode_rule():
    """gpu_probe (make gpu-check STEP=probe): a captured point never holds more than the budget
    set aside for it; a failed capture keeps its events timing and its own error, then a good
    point replays; the L2-resident decode's launch_bound is decided (issue 56)."""
    import gpu_probe

    good = probe_figures()
    assert good["misses"] == []
    assert [t.met for t in gpu_check.probe_targets(good)] == [True, True, True, True]
    assert "1.00x, 1.67x; launch_bound True" in gpu_check.probe_targets(good)[3].value
    apart = probe_figures(block_mb=2900.0)  # the block's graphs did not share their memory
    assert met(gpu_check.probe_targets(apart), "waiting together") is False
    assert any("together > 2800 alone" in m for m in apart["misses"])
    over = probe_figures(held=(900.0, 2100.0))
    assert met(gpu_check.probe_targets(over), "budget's estimate") is False
    assert any("held 2100 MB > estimate 2000 MB" in m for m in over["misses"])
    secondary = dict(
        label="reads",
        status="ok",
        timed_by="events",
        graph_error="not captured: operation failed due to a " + gpu_probe.SECONDARY,
    )
    for first, second in (
        (secondary, None),
        (None, dict(label="fused", status="ok", timed_by="events", graph_error="x")),
        (None, dict(label="fused", status="crashed", timed_by=None, graph_error=None)),
    ):
        fig = probe_figures(first=first, second=second)
        assert met(gpu_check.probe_targets(fig), "in one process") is False
    assert met(gpu_check.probe_targets(probe_figures(launch_bound=None)), "decode") is False
    assert all(t.met is None for t in gpu_check.probe_targets({}))


# the GPU probe's every target measured on the CPU (14 s here): make test-slow and CI run it
@pytest.mark.slow
def test_the_probe_measures_at_small_shapes_on_the_cpu(monkeypatch):
    """gpu_probe's three measurements run end to end (here on the CPU at small shapes: no graph,
    so only that each returns its figures); without CUDA the script exits 2 in one line."""
    import gpu_probe

    monkeypatch.setattr(gpu_probe, "SHAPE", dict(batch=1, embed_dim=32, num_heads=2))
    monkeypatch.setattr(gpu_probe, "POOL_LENGTHS", (16,))
    monkeypatch.setattr(gpu_probe.torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(gpu_probe.torch.cuda, "memory_reserved", lambda *a: 0)
    rows = gpu_probe.pool("cpu")
    assert [r["status"] for r in rows] == ["ok", "ok"]
    assert all(r["estimate_mb"] > 0 and r["held_mb"] is not None for r in rows)
    together = gpu_probe.block("cpu")
    assert together["statuses"] == ["ok", "ok"] and together["held_mb"] > 0
    first, second = gpu_probe.capture("cpu")
    # no CUDA graph on the CPU: the host's clock (the thread's CPU time with one thread)
    assert first["status"] == second["status"] == "ok" and first["timed_by"] in ("cpu", "wall")
    assert gpu_probe.decode("cpu")["status"] == "ok"
    if not torch.cuda.is_available():
        assert gpu_probe.main([]) == 2


def timer_figures(
    do_bench=(1.0, 0.99), bound=(False, False), cv=0.004, graph=(1.0, 1.01), tub=(1.0, 1.02)
):
    return dict(
        points=[
            dict(
                point=f"p{i}",
                tub_ratio=t,
                do_bench_ratio=r,
                clear_graph_ratio=g,
                cudagraph_ratio=g,
                capture_error=None if g is not None else "RuntimeError: capture failed",
                launch_bound=b,
            )
            for i, (r, b, g, t) in enumerate(zip(do_bench, bound, graph, tub))
        ],
        repeat_cv=cv,
        launch_bound_ratio=1.25,
    )


def met(targets, name_part):
    return next(t.met for t in targets if name_part in t.name)


def test_timer_targets_hold_do_bench_to_its_band_and_leave_launch_bound_points_out():
    assert met(gpu_check.timer_targets(timer_figures()), "/ do_bench at") is True
    wide = timer_figures(do_bench=(1.0, 1.2))
    assert met(gpu_check.timer_targets(wide), "/ do_bench at") is False
    # a launch-bound point's eager ratio is the host's pace: shown, not held to the band
    loose = timer_figures(do_bench=(1.0, 1.2), bound=(False, True))
    assert met(gpu_check.timer_targets(loose), "/ do_bench at") is True
    assert "p1" in next(t.value for t in gpu_check.timer_targets(loose) if "launch-bound" in t.name)
    assert "1.25x warm replay" in next(
        t.name for t in gpu_check.timer_targets(loose) if "launch-bound" in t.name
    )
    assert met(gpu_check.timer_targets(timer_figures(cv=0.05)), "repeatability") is False
    every_bound = timer_figures(bound=(True, True))
    assert met(gpu_check.timer_targets(every_bound), "/ do_bench at") is None  # nothing compared


def test_timer_targets_hold_the_graph_times_and_the_eager_time_at_every_point():
    """The flushed replay (what a row records) against the cache-clearing graph benchmark, the
    warm replay against do_bench_cudagraph, and the eager time as sweeps take it against
    torch.utils.benchmark: held at every point, launch-bound ones included (issue 56)."""
    clear, warm = "cache-clearing graph", "do_bench_cudagraph"
    eager = "torch.utils.benchmark"
    for name in (clear, warm):
        assert met(gpu_check.timer_targets(timer_figures()), name) is True
        for ratio in (0.94, 1.06):
            off = timer_figures(graph=(1.0, ratio), bound=(False, True))
            assert met(gpu_check.timer_targets(off), name) is False
        edge = timer_figures(graph=(0.95, 1.05))
        assert met(gpu_check.timer_targets(edge), name) is True
    assert met(gpu_check.timer_targets(timer_figures()), eager) is True
    assert met(gpu_check.timer_targets(timer_figures(tub=(1.0, 1.15))), eager) is False
    assert met(gpu_check.timer_targets(timer_figures(tub=(0.9, 1.1))), eager) is True
    # a call that could not be captured: named, not measured; the others still held
    one = gpu_check.timer_targets(timer_figures(graph=(1.0, None)))
    assert met(one, clear) is True and met(one, "not captured") is None
    assert "p1 (RuntimeError: capture failed)" in next(
        t.value for t in one if "not captured" in t.name
    )
    assert met(gpu_check.timer_targets(timer_figures()), "not captured") is True
    none = gpu_check.timer_targets(timer_figures(graph=(None, None)))
    assert met(none, clear) is None and met(none, warm) is None
    # nothing written (a step stopped by its deadline): every target unmeasured
    assert all(t.met is None for t in gpu_check.timer_targets({}))


def test_stability_targets():
    fig = dict(
        speedup_coverage="30/32",
        speedup_coverage_pct=93.8,
        median_speedup_rel_halfwidth_pct=2.4,
        compare_slowed_flagged="8/8",
        compare_same_code_regressions="0/32",
        rerun_noise_measured=0.015,
    )
    assert all(t.met for t in gpu_check.stability_targets(fig))
    worse = {**fig, "speedup_coverage_pct": 80.0, "compare_slowed_flagged": "5/8"}
    targets = gpu_check.stability_targets(worse)
    assert met(targets, "covering") is False and met(targets, "1.2x slower") is False
    assert met(targets, "half-width") is True
    assert all(t.met is None for t in gpu_check.stability_targets({}))  # a run that wrote nothing


def rows(*statuses, **extra):
    extra = {"timed_by": "graph", **extra}
    return [dict(status=s, timing_state="done", launch_bound="False", **extra) for s in statuses]


def test_sweep_targets_every_point_a_verdict_and_each_steps_own():
    ok = gpu_check.sweep_targets("llm_window", rows("ok", "mismatch", "unsupported"), 330, 600)
    assert all(t.met for t in ok)
    crashed = gpu_check.sweep_targets("main", rows("ok", "crashed"), 330, 600)
    assert met(crashed, "verdict") is False
    slow = gpu_check.sweep_targets("main", rows("ok"), 400, 360)
    assert met(slow, "wall time") is False  # within the step's cap
    pending = rows("ok") + [dict(status="ok", timing_state="pending")]
    assert met(gpu_check.sweep_targets("llm", pending, 10, 480), "timed to the end") is False

    long = rows("ok", seq_len="8192", check_s="0.6") + rows("ok", seq_len="8192", check_s="2.5")
    assert met(gpu_check.sweep_targets("long", long, 100, 420), "check time") is False
    assert met(gpu_check.sweep_targets("long", long[:1], 100, 420), "check time") is True
    for step in ("llm_decode", "main"):  # the budget's failure, in every sweep step
        oom = gpu_check.sweep_targets(step, rows("ok", "oom"), 100, 360)
        assert met(oom, "out of memory") is False
    # a row timed between events says why it replayed no graph (issue 56)
    said = rows("ok") + rows("ok", timed_by="events", graph_error="not captured: E", label="a")
    assert met(gpu_check.sweep_targets("main", said, 100, 360), "replaying") is True
    unsaid = rows("ok") + rows("ok", timed_by="events", label="b")
    target = next(
        t for t in gpu_check.sweep_targets("main", unsaid, 100, 360) if "replay" in t.name
    )
    assert target.met is False and "1/2 replayed; without a reason: b" == target.value
    assert met(gpu_check.sweep_targets("main", [], 5, 600), "verdict") is False


def timed(latency, half, speedup=1.5, speedup_half=None, bound="False", label="fused"):
    """A timed row: its latency and speedup intervals, ``half`` relative half-widths."""
    sh = half if speedup_half is None else speedup_half
    return dict(
        status="ok",
        timing_state="done",
        launch_bound=bound,
        label=label,
        latency_ms_median=str(latency),
        latency_ms_ci_low=str(latency * (1 - half)),
        latency_ms_ci_high=str(latency * (1 + half)),
        speedup=str(speedup),
        speedup_ci_low=str(speedup * (1 - sh)),
        speedup_ci_high=str(speedup * (1 + sh)),
    )


def ranked(*winners):
    return [
        dict(shape=f"L={i}", winner=w, contenders=w or "a;b;c;d", best=w or "a")
        for i, w in enumerate(winners)
    ]


def test_main_targets_half_widths_at_gpu_bound_points_and_winners():
    narrow = [timed(0.4, 0.02), timed(0.5, 0.025), timed(0.1, 0.2, bound="True")]
    targets = gpu_check.sweep_targets("main", narrow, 200, 360, ranked("x", "y", "", ""))
    assert met(targets, "half-width of the latency") is True  # the launch-bound row left out
    assert met(targets, "half-width of the speedup") is True
    assert met(targets, "winner") is True
    wide = narrow + [timed(0.4, 0.05), timed(0.4, 0.06)]
    assert met(gpu_check.sweep_targets("main", wide, 200, 360), "half-width of the latency") is (
        False
    )
    # the pairing reference's speedup is exactly 1: not counted
    ref = [timed(0.4, 0.02, speedup_half=0.05), timed(0.4, 0.02, speedup_half=0, label="reference")]
    assert met(gpu_check.sweep_targets("main", ref, 1, 360), "half-width of the speedup") is False
    # fewer than 2 winners: missed, and the line says why at each shape without one
    one = gpu_check.sweep_targets("main", narrow, 200, 360, ranked("x", "", "", ""))
    line = next(t for t in one if "winner" in t.name)
    assert line.met is False and line.value.startswith("1 of 4")
    assert "no winner at L=1: a tie of 4 ways within the best's interval (a, b, c, ...)" in (
        line.value
    )
    assert met(gpu_check.sweep_targets("main", narrow, 200, 360, None), "winner") is None
    only_bound = [timed(0.1, 0.2, bound="True")]
    assert met(gpu_check.sweep_targets("main", only_bound, 1, 360), "half-width") is None


def test_each_llm_step_runs_one_of_the_presets_cuda_sweeps():
    """sweep=llm's cuda_params is three sweeps: each llm step runs one, the preset's union
    turned off and its one sweep given as overrides."""
    prefill, window, decode = (
        gpu_check.llm_sweep(s) for s in ("llm_prefill", "llm_window", "llm_decode")
    )
    assert prefill["mask"] == "causal" and "kv_cache_len" not in prefill
    assert window["mask"] == "sliding" and "window" in window
    assert "kv_cache_len" in decode and decode["seq_len"] == "1"
    args = gpu_check.sweep_args("llm_decode")
    assert args[:4] == [
        "-m",
        "sweep=llm",
        "hydra.sweeper.params=null",
        "hydra.sweeper.cuda_params=null",
    ]
    assert f"kv_cache_len={decode['kv_cache_len']}" in args
    assert args[-1] == "kv_cache_len=1024,32768"  # after the preset's: it wins
    assert "mask=sliding" in gpu_check.sweep_args("llm_window")
    where = Path("/tmp/x")
    cmd = gpu_check.command("llm_prefill", where)
    assert cmd[1:3] == ["-m", "harness"] and f"hydra.sweep.dir={where / 'sweep'}" in cmd


def test_suite_targets_read_pytest_summary():
    log = (
        "SKIPPED [1] tests/test_measure.py:133: this machine has CUDA\n"
        "=== 40 passed, 1 skipped in 9.1s ==="
    )
    assert all(t.met for t in gpu_check.suite_targets(log))
    failed = "=== 1 failed, 39 passed in 9.1s ==="
    assert met(gpu_check.suite_targets(failed), "tests") is False
    skipped = "SKIPPED [2] tests/test_measure.py:197: needs CUDA\n=== 3 passed, 2 skipped in 1s ==="
    assert met(gpu_check.suite_targets(skipped), "skipped") is False
    assert met(gpu_check.suite_targets("Killed"), "tests") is None


def test_steps_write_their_summaries_one_by_one(tmp_path, monkeypatch, capsys):
    """Steps run in separate loans add up in <gpu>/summary.json; each step's folder has its own,
    and one line per target is printed. Exit 1 when a target is missed."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        gpu_check, "machine_info", lambda: dict(device_name="NVIDIA H100 80GB HBM3", torch="x")
    )
    figures = {
        "timer": [gpu_check.Target("a", 1.0, "<= 2", True)],
        "main": [gpu_check.Target("b", 3, "<= 2", False), gpu_check.Target("c", 1, "1", True)],
    }
    monkeypatch.setattr(gpu_check, "step_targets", lambda step, where, limit: figures[step])
    from harness import floors

    monkeypatch.setattr(floors, "earned", lambda kind, *a: object())  # stored: main alone
    assert gpu_check.main(["--steps", "main", "--out", str(tmp_path)]) == 1
    assert gpu_check.main(["--steps", "timer", "--out", str(tmp_path)]) == 0
    root = tmp_path / "nvidia-h100-80gb-hbm3"
    every = json.loads((root / "summary.json").read_text())
    assert list(every["steps"]) == ["timer", "main"]  # in the steps' order, not the runs'
    assert every["steps"]["main"]["met"] is False and every["steps"]["timer"]["met"] is True
    assert json.loads((root / "main" / "summary.json").read_text())["targets"][0]["value"] == 3
    out = capsys.readouterr().out
    assert "gpu-check main: b: 3 (target <= 2) MISSED" in out
    assert "gpu-check timer: a: 1.0 (target <= 2) met" in out


def test_a_sweep_step_keeps_the_csvs_and_the_report_under_fixed_names(tmp_path, monkeypatch):
    """What a sweep leaves (results, ranking, effects, the report) is copied into the step's
    folder; its work folder (traces, per-point logs) is not kept."""

    def fake_run(cmd, log, limit_s, cwd=None):
        work = Path(next(a for a in cmd if a.startswith("hydra.sweep.dir=")).split("=", 1)[1])
        work.mkdir(parents=True)
        (work / "results.csv").write_text(
            "status,timing_state,launch_bound,seq_len,check_s\nok,done,True,8192,0.4\n"
        )
        (work / "ranking.csv").write_text("x\n")
        report = Path(next(a for a in cmd if a.startswith("report_dir=")).split("=", 1)[1])
        (report / "long-sweep.html").write_text("<html></html>")
        log.write_text("done\n")
        return gpu_check.Ran(0, 12.0)

    monkeypatch.setattr(gpu_check, "run", fake_run)
    where = tmp_path / "long"
    where.mkdir()
    targets = gpu_check.sweep_step("long", where, 300)
    assert sorted(p.name for p in where.iterdir()) == [
        "log.txt",
        "ranking.csv",
        "report.html",
        "results.csv",
    ]
    assert met(targets, "check time") is True and met(targets, "launch-bound") is True


def test_the_gpu_folder_is_named_after_the_device():
    assert gpu_check.slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert gpu_check.slug("NVIDIA GeForce RTX 4090") == "nvidia-geforce-rtx-4090"


def test_a_sweep_stopped_before_any_row_has_its_targets_unmeasured(tmp_path, monkeypatch):
    stopped = "hit (300 s cap): SIGTERM at 270 s; it had printed nothing"
    monkeypatch.setattr(gpu_check, "run", lambda *a, **k: gpu_check.Ran(-15, 280.0, stopped))
    where = tmp_path / "main"
    where.mkdir()
    targets = gpu_check.sweep_step("main", where, 300)
    assert [t.met for t in targets if t.name != "deadline"] == [None] * (len(targets) - 1)
    assert targets[-1] == gpu_check.Target("deadline", stopped, "the step ends within 300 s", False)


# -- the hard deadline: no GPU needed, the step's command replaced by a silent sleeper ---------

SILENT = """
import os, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # deaf to SIGTERM: only SIGKILL ends it
child = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(40)"])
open(sys.argv[1], "w").write(f"{os.getpid()} {child.pid}")
time.sleep(40)  # prints nothing
"""


def alive(pid: int) -> bool:
    """Running (a zombie waiting for a parent that does not reap it counts as ended)."""
    stat = Path(f"/proc/{pid}/stat")
    if stat.parent.parent.exists() and Path("/proc/self").exists():
        try:
            return stat.read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
        except (FileNotFoundError, ProcessLookupError):
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def ended(pids, within=30.0) -> bool:
    stop = time.monotonic() + within
    while time.monotonic() < stop:
        if not any(alive(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


def test_a_silent_hang_is_killed_at_the_cap_and_its_summary_written(tmp_path, monkeypatch, capsys):
    """A step whose command prints nothing and ignores SIGTERM (with a child that does too) is
    killed at its cap, not when it next prints; its summary says so and is written, in its
    folder and in the GPU's."""
    pids = tmp_path / "pids"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_check, "missing_modules", lambda: [])
    monkeypatch.setattr(gpu_check, "machine_info", lambda: dict(device_name="Fake GPU"))
    monkeypatch.setattr(
        gpu_check, "command", lambda step, where: [sys.executable, "-c", SILENT, str(pids)]
    )
    monkeypatch.setattr(gpu_check, "GRACE_S", 1.0)
    cap = 3.0
    t0 = time.monotonic()
    rc = gpu_check.main(["--steps", "timer", "--out", str(tmp_path), "--limit", str(cap)])
    wall = time.monotonic() - t0
    assert rc == 1
    # SIGTERM at cap - grace was ignored: SIGKILL at cap (the sleeper would sleep 40 s; the
    # margin is for a busy machine)
    assert cap - 0.5 <= wall < cap + 20, wall
    assert ended([int(p) for p in pids.read_text().split()])  # the command and its child
    step = json.loads((tmp_path / "fake-gpu" / "timer" / "summary.json").read_text())
    assert step["met"] is False
    line = next(t for t in step["targets"] if t["name"] == "deadline")
    assert line["met"] is False and "SIGKILL" in line["value"]
    assert "it had printed nothing" in line["value"]
    others = [t["met"] for t in step["targets"] if t["name"] != "deadline"]
    assert others and all(m is None for m in others)  # the figures it could not measure
    every = json.loads((tmp_path / "fake-gpu" / "summary.json").read_text())
    assert every["steps"]["timer"]["met"] is False
    assert "gpu-check timer: deadline: hit (3 s cap)" in capsys.readouterr().out


def test_the_deadline_fires_without_output_and_names_the_last_line(tmp_path):
    """A command that printed once and then hangs: SIGTERM at the cap less the grace ends it; the
    deadline's line quotes what it last printed. One that ends in time is left alone."""
    hang = "import time; print('checking point 7', flush=True); time.sleep(40)"
    t0 = time.monotonic()
    # a 6 s cap: the child has 5 s to start and print on a busy machine before its SIGTERM; it
    # would sleep 40 s, so ending well before that is the deadline's doing
    ran = gpu_check.run([sys.executable, "-c", hang], tmp_path / "log.txt", 6.0, grace_s=1.0)
    assert time.monotonic() - t0 < 6.0 + 20
    assert ran.rc == -15 and ran.stopped and "SIGTERM" in ran.stopped
    assert "SIGKILL" not in ran.stopped and "'checking point 7'" in ran.stopped
    assert (tmp_path / "log.txt").read_text() == "checking point 7\n"
    ok = gpu_check.run([sys.executable, "-c", "print('done')"], tmp_path / "ok.txt", 30.0)
    assert ok.rc == 0 and ok.stopped is None and gpu_check.deadline(ok, 30.0) == []


def test_a_step_that_fails_in_gpu_check_itself_still_writes_its_summary(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_check, "missing_modules", lambda: [])
    monkeypatch.setattr(gpu_check, "machine_info", lambda: dict(device_name="Fake GPU"))

    def broken(step, where, limit):
        raise ValueError("llm.yaml: 2 cuda_params sweeps for llm_window, not one")

    monkeypatch.setattr(gpu_check, "step_targets", broken)
    assert gpu_check.main(["--steps", "llm_window", "--out", str(tmp_path)]) == 1
    step = json.loads((tmp_path / "fake-gpu" / "llm_window" / "summary.json").read_text())
    assert step["met"] is False and "2 cuda_params sweeps" in step["targets"][0]["value"]


def test_a_killed_sweep_has_the_rows_its_jobs_wrote_gathered(tmp_path, monkeypatch):
    """SIGKILL leaves no results.csv: the rows the jobs wrote are gathered by gpu-check."""

    def killed(cmd, log, limit_s, cwd=None):
        work = Path(next(a for a in cmd if a.startswith("hydra.sweep.dir=")).split("=", 1)[1])
        for job in ("0", "1"):
            (work / job).mkdir(parents=True)
            (work / job / "result.csv").write_text(
                f"status,config_hash,timing_state,seq_len,check_s\nok,{job}abc,done,8192,0.5\n"
            )
        return gpu_check.Ran(-9, 300.0, "hit (300 s cap): SIGTERM at 270 s, SIGKILL at 300 s")

    monkeypatch.setattr(gpu_check, "run", killed)
    where = tmp_path / "long"
    where.mkdir()
    targets = gpu_check.sweep_step("long", where, 300)
    assert (where / "results.csv").exists()
    assert next(t.value for t in targets if t.name == "points with a verdict") == "2 ok"
    assert met(targets, "check time") is True and met(targets, "deadline") is False


# -- validate_timer's CUDA figures, from made-up timers -----------------------------------------


def fake_timers(
    monkeypatch,
    eager,
    device,
    warm,
    cudagraph,
    do_bench,
    capture=None,
    clear_graph=None,
    flushed_eager=None,
):
    """validate_timer with made-up timers: the harness's eager time (no flush, as sweeps take it;
    ``flushed_eager`` with the flush), its device time (the flushed replay) and warm replay, and
    the benchmarks each is held against."""
    import validate_timer as vt

    def harness_ms(point, graph=False, flush=None):
        if not graph:
            return flushed_eager or eager if flush else eager
        return warm if flush is False else device

    monkeypatch.setattr(vt, "harness_ms", harness_ms)
    monkeypatch.setattr(vt, "tub_ms", lambda point: eager * 1.02)
    monkeypatch.setattr(vt, "do_bench_ms", lambda point: do_bench)
    monkeypatch.setattr(vt, "do_bench_cudagraph_ms", lambda point: cudagraph)
    monkeypatch.setattr(vt, "graph_with_cache_clear_ms", lambda point: clear_graph or device)
    monkeypatch.setattr(vt, "capture_refused", lambda point: capture)
    return vt


def test_validate_timer_holds_each_recorded_time_to_a_timer_that_takes_it_alike(monkeypatch):
    """launch_bound is eager time >= harness.schema.LAUNCH_BOUND x the warm replay (as a row's
    rule compares them); the flushed replay is held against the cache-clearing graph benchmark,
    the warm one against do_bench_cudagraph (which flushes nothing), the eager time as sweeps
    take it (no flush) against torch.utils.benchmark, the flushed eager time against do_bench."""
    from harness.schema import LAUNCH_BOUND

    vt = fake_timers(monkeypatch, 0.098 * LAUNCH_BOUND * 1.1, 0.10, 0.098, 0.100, 0.1)
    row = vt.time_point(None, cuda=True)
    assert row["launch_bound"] is True and row["cudagraph_ratio"] == pytest.approx(0.98)
    assert row["clear_graph_ratio"] == pytest.approx(1.0)
    assert row["flush_ratio"] == pytest.approx(0.10 / 0.098)
    assert row["tub_ratio"] == pytest.approx(1 / 1.02)
    assert not vt.misses(row, cuda=True)  # its do_bench ratio (1.1 x LAUNCH_BOUND) not counted
    # eager 1.2x the flushed replay but 1.3x the warm one: launch-bound like for like
    vt = fake_timers(monkeypatch, 0.12, 0.10, 0.092, 0.092, 0.12)
    assert vt.time_point(None, cuda=True)["launch_bound"] is True
    vt = fake_timers(monkeypatch, 0.098 * LAUNCH_BOUND * 0.9, 0.10, 0.098, 0.100, 0.1)
    row = vt.time_point(None, cuda=True)
    assert row["launch_bound"] is False and vt.misses(row, cuda=True) is (
        not 0.95 <= 0.098 * LAUNCH_BOUND * 0.9 / 0.1 <= 1.05
    )
    # the flushed eager time is what do_bench is held to
    vt = fake_timers(monkeypatch, 0.09, 0.10, 0.098, 0.100, 0.1, flushed_eager=0.1)
    row = vt.time_point(None, cuda=True)
    assert row["do_bench_ratio"] == pytest.approx(1.0) and not vt.misses(row, cuda=True)
    # the device time off the cache-clearing benchmark by 8%: a miss, launch-bound or not
    vt = fake_timers(monkeypatch, 0.3, 0.108, 0.1, 0.100, 0.3, clear_graph=0.1)
    assert vt.misses(vt.time_point(None, cuda=True), cuda=True)
    # the warm replay off do_bench_cudagraph's by 8%: a miss too
    vt = fake_timers(monkeypatch, 0.3, 0.10, 0.108, 0.100, 0.3)
    assert vt.misses(vt.time_point(None, cuda=True), cuda=True)
    # a call that cannot be captured: no device time, no rule, its eager figures kept
    vt = fake_timers(monkeypatch, 0.3, 0.1, 0.1, 0.1, 0.3, capture="cannot capture")
    row = vt.time_point(None, cuda=True)
    assert row["capture_error"] == "cannot capture" and row["device_ms"] is None
    assert row["launch_bound"] is None and row["cudagraph_ratio"] is None
    assert row["clear_graph_ratio"] is None
    assert row["do_bench_ratio"] == pytest.approx(1.0) and not vt.misses(row, cuda=True)


@pytest.mark.parametrize("stopped", [None, "hit (300 s cap): SIGTERM at 270 s; ..."])
def test_a_timer_step_cut_short_keeps_the_points_it_finished(tmp_path, monkeypatch, stopped):
    """validate_timer writes its figures after every point: a step stopped by its deadline (or
    a crash) keeps the points it finished; what it did not reach is unmeasured, and the step
    still misses (the deadline, or the figures incomplete)."""
    partial = {**timer_figures(), "repeat_cv": None, "complete": False}

    def cut(cmd, log, limit_s, cwd=None):
        Path(cmd[cmd.index("--json") + 1]).write_text(json.dumps(partial))
        return gpu_check.Ran(-15 if stopped else 1, 280.0, stopped)

    monkeypatch.setattr(gpu_check, "run", cut)
    targets = gpu_check.step_targets("timer", tmp_path, 300)
    assert met(targets, "cache-clearing graph") is True and met(targets, "repeatability") is None
    missed = [t.name for t in targets if t.met is False]
    assert missed == (["deadline"] if stopped else ["timer.json"])


def test_the_models_step_runs_the_presets_cuda_half_and_asks_every_point_ok():
    """sweep=models' CUDA half had no step (issue 59): a mismatch there is a wrong way of ours,
    so the step misses where any point is not ok, not only where one failed."""
    assert "models" in gpu_check.STEPS and gpu_check.LIMIT_S["models"] <= 360
    assert gpu_check.sweep_args("models") == ["sweep=models"]
    cmd = gpu_check.command("models", Path("/tmp/x"))
    assert cmd[1:4] == ["-m", "harness", "sweep=models"]
    ok = {"status": "ok", "timed_by": "graph", "timing_state": "done"}
    rows = [ok, {**ok, "status": "mismatch"}]
    line = met(gpu_check.sweep_targets("models", rows, 100, 360), "match nn.MultiheadAttention")
    assert line is False
    assert met(gpu_check.sweep_targets("models", [ok, ok], 100, 360), "match nn.Multi") is True
    assert not any("match nn.Multi" in t.name for t in gpu_check.sweep_targets("long", rows, 1, 9))


def test_stability_runs_before_main_where_no_cuda_floor_is_stored():
    """Issue 71: without an earned CUDA floor main's intervals rest on the assumed 0.02 (3.92%
    half-width, over its 3% target): stability is run first, and the run says so."""
    steps = ["probe", "timer", "main", "stability", "long"]
    got, said = gpu_check.stability_first(steps, None)
    assert got == ["probe", "timer", "stability", "main", "long"] and "no CUDA floor" in said
    assert gpu_check.stability_first(["main"], None)[0] == ["stability", "main"]
    assert gpu_check.stability_first(steps, object()) == (steps, None)  # a floor is stored
    assert gpu_check.stability_first(["stability", "main"], None) == (["stability", "main"], None)
    assert gpu_check.stability_first(["timer"], None) == (["timer"], None)
