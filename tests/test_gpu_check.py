"""`make gpu-check` (scripts/gpu_check.py) without a GPU: its one-line refusal, its targets from
made-up figures, and the files it leaves (docs/measurements.md, "On a GPU")."""

from __future__ import annotations

import json
import subprocess
import sys
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
    assert out == ["gpu-check: unknown step 'warp'; steps are " + ", ".join(gpu_check.STEPS)]


def timer_figures(do_bench=(1.0, 0.99), bound=(False, False), cv=0.004):
    return dict(
        points=[
            dict(point=f"p{i}", tub_ratio=0.8, do_bench_ratio=r, launch_bound=b)
            for i, (r, b) in enumerate(zip(do_bench, bound))
        ],
        repeat_cv=cv,
    )


def met(targets, name_part):
    return next(t.met for t in targets if name_part in t.name)


def test_timer_targets_hold_do_bench_to_its_band_and_leave_launch_bound_points_out():
    assert met(gpu_check.timer_targets(timer_figures()), "do_bench") is True
    assert met(gpu_check.timer_targets(timer_figures(do_bench=(1.0, 1.2))), "do_bench") is False
    # a launch-bound point's ratio is the host's pace: shown, not held to the band
    loose = timer_figures(do_bench=(1.0, 1.2), bound=(False, True))
    assert met(gpu_check.timer_targets(loose), "do_bench") is True
    assert met(gpu_check.timer_targets(timer_figures(cv=0.05)), "repeatability") is False
    every_bound = timer_figures(bound=(True, True))
    assert met(gpu_check.timer_targets(every_bound), "do_bench") is None  # nothing to compare


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
    return [dict(status=s, timing_state="done", launch_bound="False", **extra) for s in statuses]


def test_sweep_targets_every_point_a_verdict_and_each_steps_own():
    ok = gpu_check.sweep_targets("main", rows("ok", "mismatch", "unsupported"), 330, 600)
    assert all(t.met for t in ok)
    crashed = gpu_check.sweep_targets("main", rows("ok", "crashed"), 330, 600)
    assert met(crashed, "verdict") is False
    slow = gpu_check.sweep_targets("main", rows("ok"), 700, 800)
    assert met(slow, "wall time") is False  # the main job's own target: 10 minutes
    pending = rows("ok") + [dict(status="ok", timing_state="pending")]
    assert met(gpu_check.sweep_targets("llm", pending, 10, 480), "timed to the end") is False

    long = rows("ok", seq_len="8192", check_s="0.6") + rows("ok", seq_len="8192", check_s="2.5")
    assert met(gpu_check.sweep_targets("long", long, 100, 420), "check time") is False
    assert met(gpu_check.sweep_targets("long", long[:1], 100, 420), "check time") is True
    oom = gpu_check.sweep_targets("llm", rows("ok", "oom"), 100, 480)
    assert met(oom, "out of memory") is False
    assert met(gpu_check.sweep_targets("main", [], 5, 600), "verdict") is False


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
        return 0, 12.0

    monkeypatch.setattr(gpu_check, "run", fake_run)
    where = tmp_path / "long"
    where.mkdir()
    targets = gpu_check.sweep_step("long", gpu_check.LONG, where, 420)
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
