"""A failed point keeps its traceback: on disk beside its row (traceback.txt), in the run's log
file, and gathered into errors.log beside results.csv, one section per failed point naming its
job; a crashed worker leaves no Python traceback, and its section keeps what the row says."""

import sys

import pandas as pd

from harness import time_it
from harness.results import TRACEBACK
from harness.results import (
    ERRORS_FILE,
    TRACEBACK_FILE,
    errors_text,
    write_errors,
    write_results,
    write_row,
)
from tests.conftest import REPO, TINY, run_harness

FAULTY = REPO / "tests" / "faulty"
NEGATIVE = REPO / "tests" / "negative"
DECODE = dict(embed_dim=32, num_heads=8, num_kv_heads=2, kv_cache_len=8, seq_len=1, batch=2)


def test_a_sweep_writes_errors_log_with_a_section_per_failed_point(tmp_path):
    proc = run_harness(
        "--config-dir",
        str(FAULTY),
        "-m",
        "variant=fused,exits_in_forward,aborts_in_forward",
        "check_only=true",
        *TINY,
        "hydra.sweep.dir=sweep",
        cwd=tmp_path,
        paths=[FAULTY],
    )
    root = tmp_path / "sweep"
    assert (root / "results.csv").exists(), proc.stderr[-3000:]
    df = pd.read_csv(root / "results.csv")
    assert set(df["status"]) == {"ok", "error", "crashed"}, df[["variant", "status"]]
    text = (root / ERRORS_FILE).read_text()
    sections = text.split("== job ")[1:]
    assert len(sections) == 2, text  # the ok point has none
    exits, aborts = sections
    assert exits.startswith("1 (variant=exits_in_forward") and ": error ==" in exits
    assert "Traceback (most recent call last)" in exits and "faults.py" in exits
    assert exits.rstrip().endswith("SystemExit: 3")
    assert aborts.startswith("2 (variant=aborts_in_forward") and ": crashed ==" in aborts
    assert "SIGABRT" in aborts and "no Python traceback" in aborts
    assert (root / "1" / TRACEBACK_FILE).exists() and not (root / "0" / TRACEBACK_FILE).exists()
    # the run's log file has it; the console keeps one line per point
    logged = "".join(p.read_text() for p in (root / "1").glob("*.log"))
    assert "Traceback (most recent call last)" in logged and "SystemExit: 3" in logged
    assert "Traceback" not in proc.stdout


def test_a_single_run_writes_errors_log_beside_its_results(tmp_path):
    """A timed call that raises after a passing check (tests/negative/mistakes.py's
    PositionAsserted): an empty AssertionError, whose traceback names the assert."""
    proc = run_harness(
        "--config-dir",
        str(NEGATIVE),
        "variant=textbook",
        "variant._target_=mistakes.PositionAsserted",
        "embed_dim=32",
        "num_heads=8",
        "kv_cache_len=8",
        "seq_len=1",
        *[a for a in TINY if not a.startswith(("embed_dim", "num_heads", "seq_len"))],
        "hydra.run.dir=run",
        cwd=tmp_path,
        paths=[NEGATIVE],
    )
    root = tmp_path / "run"
    row = pd.read_csv(root / "results.csv").iloc[0]
    assert row["status"] == "error", (row["error"], proc.stderr[-2000:])
    text = (root / ERRORS_FILE).read_text()
    assert text.startswith("== job . (") and "AssertionError" in text
    assert "assert cache is None or self.position == cache.length" in text


def test_the_row_of_a_failed_point_carries_its_traceback_and_write_row_keeps_it(tmp_path):
    sys.path.insert(0, str(NEGATIVE))
    row = time_it(
        "mistakes.PositionAsserted",
        **DECODE,
        timing={"rounds": 2, "round_time": 0.005, "warmup": 0.005},
    )
    assert row["status"] == "error" and "Traceback" in row[TRACEBACK]
    job = tmp_path / "0"
    job.mkdir()
    write_row(job, {**row, "config_hash": "h"})
    assert "AssertionError" in (job / TRACEBACK_FILE).read_text()
    assert TRACEBACK not in pd.read_csv(job / "result.csv").columns
    write_results(tmp_path)
    assert "== job 0 (" in (tmp_path / ERRORS_FILE).read_text()
    ok = {k: v for k, v in row.items() if k != TRACEBACK}
    write_row(job, {**ok, "status": "ok", "error": "", "config_hash": "h"})
    assert not (job / TRACEBACK_FILE).exists()
    assert errors_text(tmp_path) == "" and write_errors(tmp_path) is None
    assert not (tmp_path / ERRORS_FILE).exists()  # an earlier errors.log goes with its failures
