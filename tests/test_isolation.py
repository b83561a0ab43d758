"""Nothing escapes its row: crashes, exits and hangs in their worker, CI exit codes, one sweep
per dir, refusals in one line, and the drop-in contract (tests/faulty is the gallery)."""

import json
import signal
import subprocess
import sys
import time

import pandas as pd
import pytest
import torch

from tests.conftest import REPO, TINY, harness_env, run_harness

FAULTY = REPO / "tests" / "faulty"
GALLERY = [
    "fused",
    "reference",
    "exits_in_forward",
    "os_exit_in_forward",
    "aborts_in_forward",
    "killed_in_forward",
    "hangs_in_forward",
    "crashes_in_rounds",
    "interrupts_in_forward",
    "meta_out",
    "float64_out",
    "mutates_query",
    "mutates_mask",
    "leaks_outputs",
]
# Warm-up by count (2 calls) so crashes_in_rounds (its 40th call) survives its set-up; rounds
# long enough for the leak to show over several of them.
QUICK = [
    a for a in TINY if not a.startswith(("timing.warmup", "timing.round_time", "timing.rounds"))
] + ["timing.warmup=0", "timing.round_time=0.02", "timing.rounds=4"]


def faulty(*args, cwd, timeout=300):
    return run_harness("--config-dir", str(FAULTY), *args, cwd=cwd, paths=[FAULTY], timeout=timeout)


def by_label(df: pd.DataFrame) -> dict:
    return {r["variant"]: r for r in df.to_dict("records")}


# the faulty gallery's sweep (50 s here; its hang waits out a timeout): make test-slow and CI run it
@pytest.mark.slow
def test_faulty_gallery_every_point_gets_its_row_and_the_good_ones_stay_ok(tmp_path):
    """Every fault of tests/faulty in one timing sweep (about 35 s: a hang waits out its 20 s
    point_timeout, and each crash costs a fresh worker process)."""
    proc = faulty(
        "-m",
        f"variant={','.join(GALLERY)}",
        "mask=padding",
        "point_timeout=20",  # a point's set-up took over 6 s at load 7 (2 cores)
        *QUICK,
        "hydra.sweep.dir=sweep",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]  # a timing sweep records failures and goes on
    df = pd.read_csv(tmp_path / "sweep" / "results.csv")
    assert len(df) == len(GALLERY)  # a row for every point
    rows = by_label(df)
    for good in ("fused", "reference"):
        assert rows[good]["status"] == "ok", rows[good]["error"]
        # every round (more where the shape was re-timed for a neighbour's spoiled round), unless a
        # busy machine spoiled some of its own (re-timed or left out)
        assert rows[good]["n_samples"] >= 4 or rows[good]["contended_rounds"] > 0
        assert rows[good]["leak"] in (False, "False")
    assert (rows["exits_in_forward"]["status"], rows["exits_in_forward"]["error"]) == (
        "error",
        "SystemExit: 3",
    )
    expected = {
        "os_exit_in_forward": ("crashed", "exited with code 3"),
        "aborts_in_forward": ("crashed", "SIGABRT"),
        "killed_in_forward": ("crashed", "killed by SIGKILL, likely out of memory"),
        "hangs_in_forward": ("timeout", "point_timeout=20"),
        "crashes_in_rounds": ("crashed", "timing round"),
        "float64_out": ("mismatch", "out dtype float64, expected float32"),
        "mutates_query": ("mismatch", "query modified in place"),
        "mutates_mask": ("mismatch", "key_padding_mask modified in place"),
        # issue 58: its own KeyboardInterrupt, not a Ctrl-C (it read "crashed: killed by
        # SIGINT"); an output that holds no numbers (it read `unsupported`, so a gate passed)
        "interrupts_in_forward": ("error", "raised by the point's own code"),
        "meta_out": ("mismatch", "out device meta, expected cpu"),
    }
    for name, (status, words) in expected.items():
        assert rows[name]["status"] == status and words in rows[name]["error"], (
            name,
            rows[name]["error"],
        )
    assert rows["crashes_in_rounds"]["check_passed"] in (
        True,
        "True",
    )  # its check passed before it died
    leaky = rows["leaks_outputs"]
    assert (
        leaky["status"] == "ok" and leaky["leak"] in (True, "True") and leaky["mem_growth_mb"] > 1
    )
    assert "LEAK" in proc.stdout
    html = (tmp_path / "sweep" / "report.html").read_text()
    assert 'class="leak"' in html and "crashed" in html and "timeout" in html


def test_a_sticky_cuda_error_costs_its_own_row_and_later_points_run_in_a_fresh_worker(tmp_path):
    """breaks_in_check and breaks_in_rounds fail as CUDA does after an illegal address: every
    later call in their process fails too. Without a fresh worker fused and reference would be
    `error` as well."""
    proc = faulty(
        "-m",
        "variant=breaks_in_check,fused,breaks_in_rounds,reference",
        *QUICK,
        "hydra.sweep.dir=sweep",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = by_label(pd.read_csv(tmp_path / "sweep" / "results.csv"))
    for broke in ("breaks_in_check", "breaks_in_rounds"):
        assert rows[broke]["status"] == "error", rows[broke]
        assert "illegal memory access" in rows[broke]["error"]
        assert "the worker was restarted" in rows[broke]["error"]
    for good in ("fused", "reference"):
        assert rows[good]["status"] == "ok", rows[good]["error"]
        # every round (more where the shape was re-timed for a neighbour's spoiled round), unless a
        # busy machine spoiled some of its own (re-timed or left out)
        assert rows[good]["n_samples"] >= 4 or rows[good]["contended_rounds"] > 0
    assert "points that waited in it are prepared again" in proc.stdout + proc.stderr


@pytest.mark.parametrize(
    "text, status",
    [
        ("CUDA out of memory. Tried to allocate 2.00 GiB", "oom"),
        ("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`", "oom"),
        ("cuDNN error: CUDNN_STATUS_ALLOC_FAILED", "oom"),
        ("CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED", "oom"),
        (
            "out of resource: shared memory, Required: 196608, Hardware limit: 101376. "
            "Reducing block sizes or `num_stages` may help.",
            "unsupported",
        ),
        (
            "NotImplementedError: NYI: embedding dimension of the query, key, and value must be "
            "at least 16 but got E=8 and Ev=8",
            "unsupported",
        ),
        ("No available kernel. Aborting execution.", "unsupported"),
        ("CUDA error: an illegal memory access was encountered", "error"),
        ("shapes cannot be multiplied", "error"),
    ],
)
def test_failures_are_classified_by_the_texts_libraries_raise(text, status):
    from harness.errors import is_sticky

    # inductor and Dynamo wrap what they catch in their own exception types: the text decides
    assert classify(RuntimeError(text)) == status
    assert is_sticky(text) == ("illegal memory access" in text)


def test_dynamos_recompile_limit_is_an_error_naming_it_never_a_silent_eager_run(monkeypatch):
    from harness.errors import one_line
    from harness.way.compiling import compile_static

    double = compile_static(lambda x: x * 2)
    double(torch.ones(2))
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 1)
    with pytest.raises(Exception) as failure:
        double(torch.ones(3))  # a second static shape: a recompile past the limit
    assert "recompile limit was reached" in one_line(failure.value)


def test_check_only_gate_fails_on_a_crash_and_prints_what_it_checked(tmp_path):
    proc = faulty(
        "-m",
        "variant=fused,os_exit_in_forward,exits_in_forward",
        "check_only=true",
        *TINY,
        "hydra.sweep.dir=sweep",
        cwd=tmp_path,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "checked 1 (1 passed, 0 failed)" in proc.stdout and "did not run 2" in proc.stdout
    assert proc.stderr.count("check failed:") == 2
    assert (
        proc.stdout.strip().splitlines()[-1].startswith("report: ")
    )  # the report is still written


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="needs a machine where device=cuda is unsupported"
)
def test_check_only_gate_fails_when_nothing_was_checked(harness_cli, tmp_path):
    proc = harness_cli(
        "-m",
        "variant=fused,separate",
        "device=cuda",
        "check_only=true",
        *TINY,
        "hydra.sweep.dir=sweep",
    )
    assert proc.returncode == 1
    assert (
        "checked 0 (0 passed, 0 failed), unsupported 2" in proc.stdout
        and "no point was checked" in proc.stdout
    )


def test_single_run_exits_nonzero_when_its_point_is_not_ok(tmp_path):
    proc = faulty("variant=exits_in_forward", *TINY, "hydra.run.dir=run", cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert pd.read_csv(tmp_path / "run" / "results.csv")["status"].tolist() == ["error"]
    assert (tmp_path / "run" / "report.html").exists()


@pytest.mark.slow  # two sweeps into one dir (20 s here): make test-slow and CI run it
def test_a_new_sweep_into_an_old_dir_reports_only_its_own_points(harness_cli, tmp_path):
    first = harness_cli("-m", "seed=0,1", *TINY, "hydra.sweep.dir=sweep")
    assert first.returncode == 0, first.stderr[-2000:]
    (tmp_path / "sweep" / "1" / "result.csv").write_bytes(
        b"\xff\xfe\x00garbage\n\x81"
    )  # not this sweep's
    second = harness_cli("-m", "seed=7", *TINY, "hydra.sweep.dir=sweep")
    assert second.returncode == 0, second.stderr[-2000:]
    assert pd.read_csv(tmp_path / "sweep" / "results.csv")["seed"].tolist() == [7]
    assert (tmp_path / "sweep" / "1" / "result.csv").exists()  # old job dirs are left as they were
    listed = json.loads((tmp_path / "sweep" / "jobs.json").read_text())["jobs"]
    assert [j["dir"] for j in listed] == ["0"]


@pytest.mark.slow  # two sweeps, one killed (28 s here): make test-slow and CI run it
def test_a_second_sweep_into_a_running_sweeps_dir_is_refused_and_a_killed_one_leaves_no_lock(
    harness_cli, tmp_path
):
    slow = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "harness",
            "-m",
            "seed=0,1,2,3",
            *TINY,
            "timing.rounds=40",
            "timing.round_time=0.05",
            "hydra.sweep.dir=sweep",
        ],
        cwd=tmp_path,
        env=harness_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "sweep" / "env.json").exists():
            assert slow.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        second = harness_cli("-m", "seed=5", *TINY, "hydra.sweep.dir=sweep")
        assert second.returncode == 2
        lines = second.stderr.strip().splitlines()
        assert (
            len(lines) == 1
            and lines[0].startswith("error: ")
            and "in use by a running sweep" in lines[0]
        )
        # issue 74: with its lock file deleted, a second sweep ran and overwrote three rows
        locks = [p for p in (tmp_path / "sweep").iterdir() if "lock" in p.name]
        assert locks, list((tmp_path / "sweep").iterdir())
        for lock in locks:
            lock.unlink()
        fourth = harness_cli("-m", "seed=5", *TINY, "hydra.sweep.dir=sweep")
        assert fourth.returncode == 2 and "in use by a running sweep" in fourth.stderr, (
            fourth.stderr[-2000:]
        )
    finally:
        slow.send_signal(signal.SIGKILL)
        slow.wait()
    third = harness_cli("-m", "seed=5", *TINY, "hydra.sweep.dir=sweep")
    assert third.returncode == 0, third.stderr[-2000:]
    assert pd.read_csv(tmp_path / "sweep" / "results.csv")["seed"].tolist() == [5]


@pytest.mark.parametrize(
    "args,words",
    [
        (["+seq_lenn=5"], "seq_lenn=5 is not a config key (did you mean seq_len?)"),
        (
            ["-m", "+num_head=8", "seed=0,1"],
            "num_head=8 is not a config key (did you mean num_heads?)",
        ),
        (["seq_lenn=5"], "seq_lenn is not a config key (did you mean seq_len?)"),
        (
            ["sweep=nope"],
            "sweep='nope' is not in the sweep group "
            "(known: default, llm, mla, models, race, smoke, toggles)",
        ),
        (["variant=nope"], "variant='nope' is not in the variant group"),
        (["batch=[1"], "cannot parse the override 'batch=[1'"),
        # issue 74: a swept value a single run refuses, refused before the first point (it
        # crashed the sweep at its point, in the progress line, and left no results.csv)
        (
            ["-m", "mask=documents", "documents=2,inf"],
            "documents=inf must be an integer 1 .. seq_len",
        ),
        (["-m", "num_kv_heads=1,nan"], "num_kv_heads=nan must be a positive integer"),
        (
            ["-m", "seq_len=1", "kv_cache_len=4,inf", "kv_cache=paged", "page_size=2,inf"],
            "kv_cache_len=inf must be a positive integer",
        ),
    ],
)
def test_refusals_are_one_error_line_and_exit_2(harness_cli, tmp_path, args, words):
    proc = harness_cli(*args, *TINY, "hydra.sweep.dir=sweep", "hydra.run.dir=run")
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], proc.stderr
    assert (
        not (tmp_path / "sweep" / "0").exists() and not (tmp_path / "run" / "result.csv").exists()
    )


def test_unwritable_report_dir_is_refused_before_the_first_point(harness_cli, tmp_path):
    (tmp_path / "afile").write_text("not a dir")
    proc = harness_cli("-m", "seed=0,1", *TINY, "report_dir=afile/reports", "hydra.sweep.dir=sweep")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: cannot write to afile/reports: Not a directory"
    ]
    assert not list((tmp_path / "sweep").glob("*/result.csv"))  # nothing ran


def test_report_copy_failure_keeps_the_runs_own_report_and_exits_3(harness_cli, tmp_path):
    copy = tmp_path / "reports" / f"{tmp_path.name}-run.html"
    copy.mkdir(parents=True)  # the copy's name, taken by a dir
    proc = harness_cli(*TINY, "hydra.run.dir=run")
    assert proc.returncode == 3
    assert (tmp_path / "run" / "report.html").exists()
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and str(copy) in errors[0], proc.stderr


def test_results_that_cannot_be_written_exit_3_naming_the_file(harness_cli, tmp_path):
    (tmp_path / "run" / "results.csv").mkdir(parents=True)
    proc = harness_cli(*TINY, "hydra.run.dir=run")
    assert proc.returncode == 3
    assert (
        proc.stderr.strip().splitlines()[-1].startswith("error: cannot write ")
        and "results.csv" in proc.stderr
    )


# -- the same rules, unit by unit (no subprocess) -------------------------------------------------
from harness.errors import classify  # noqa: E402


def test_a_deleted_dynamo_limit_is_set_again_not_an_error_at_every_later_point():
    """torch's config module hides an entry that is deleted (``delattr``; unittest.mock's undo
    deletes before it sets): reading it then raises "... does not exist", which ended the flex
    tests' points in ``error`` after other tests in the same process (issue 72)."""
    from harness.way.compiling import RECOMPILE_LIMIT, loud_limits

    config = torch._dynamo.config
    before = config.recompile_limit
    try:
        delattr(config, "recompile_limit")
        with pytest.raises(AttributeError, match="does not exist"):
            config.recompile_limit
        loud_limits()
        assert config.recompile_limit >= RECOMPILE_LIMIT
        assert config.fail_on_recompile_limit_hit is True
    finally:
        config.recompile_limit = max(before, RECOMPILE_LIMIT)


@pytest.mark.parametrize("command", [["-m", "harness", "-m"], ["-m", "harness.cli", "race"]])
def test_a_variant_yaml_with_a_syntax_error_is_one_line_naming_the_file(tmp_path, command):
    """Issue 74: ``run -m`` and ``race`` ended in a yaml traceback."""
    import subprocess
    import sys

    from tests.conftest import harness_env

    (tmp_path / "variant").mkdir()
    (tmp_path / "variant" / "broken.yaml").write_text(
        "_target_: variants.fused.FusedQKVMHA\nattention: [sdpa\n"
    )
    which = ["broken"] if command[-1] == "race" else []
    rest = which + ["--config-dir", str(tmp_path)] + ([] if which else ["variant=broken"]) + [
        "seq_len=8", "check_only=true", "hydra.sweep.dir=sweep"
    ]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, *command, *rest], cwd=tmp_path, env=harness_env(),
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "broken.yaml, line 3" in lines[0], proc.stderr[-2000:]
    assert "YAML syntax error" in lines[0] and "Traceback" not in proc.stderr


def test_a_progress_line_and_a_label_show_any_count_without_crashing():
    """Issue 74: ``int(inf)`` in the progress line ended a sweep with documents=2,inf (and
    `report` on its dir the same way); page_size=2.5 read as paged:2."""
    from harness.progress import case
    from harness.validate import count

    assert [count(v) for v in (2, 2.0, 2.5, float("inf"), float("nan"))] == [
        "2", "2", "2.5", "inf", "nan"
    ]  # fmt: skip
    row = dict(variant="fused", batch=2, seq_len=16, embed_dim=32, num_heads=4, dtype="float32",
               device="cpu", mask="documents", documents=float("inf"), window=float("inf"),
               kv_cache_len=float("inf"), num_kv_heads=float("nan"))  # fmt: skip
    said = case(row)
    assert "docs=inf" in said, said


def test_resume_after_a_value_is_added_to_a_swept_key_keeps_every_finished_point(
    harness_cli, tmp_path
):
    """Issue 74: a value added to a swept key renumbers the jobs, and resume ran 15 of 16
    finished points again; they are matched by their configuration, not their job number."""
    first = harness_cli("-m", *TINY, "seq_len=8,16", "check_only=true", "hydra.sweep.dir=sweep")
    assert first.returncode == 0, first.stderr[-2000:]
    again = harness_cli("-m", *TINY, "seq_len=4,8,16", "check_only=true", "resume=true",
                        "hydra.sweep.dir=sweep")  # fmt: skip
    assert again.returncode == 0, again.stderr[-2000:]
    text = again.stdout + again.stderr
    assert text.count("skipped") == 2, text[-3000:]
    rows = pd.read_csv(tmp_path / "sweep" / "results.csv")
    assert sorted(rows["seq_len"]) == [4, 8, 16] and (rows["status"] == "ok").all()
