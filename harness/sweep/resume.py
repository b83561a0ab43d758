"""``resume=true``: what a point does with the row an earlier run of its sweep left (skipped, its
rounds continued, or run again), and the finished rows kept by configuration as the sweep
starts, so that a job number that changed loses nothing (docs/guide.md, "Stopping and
resuming")."""

from __future__ import annotations

import logging
from pathlib import Path

from harness.files import atomic_write_text
from harness.results import ROW_FILE, read_row

log = logging.getLogger("harness")


# Where a resumed sweep keeps its finished rows by configuration as it starts (``keep_finished``)
KEPT_DIR = ".finished"


def keep_finished(root: Path) -> int:
    """Before a resumed sweep's first job: each job dir's finished ``ok`` row copied under
    ``KEPT_DIR`` by its configuration's hash, so that a point whose job number changed finds it
    (a value added to a swept key renumbered the jobs and 15 of 16 finished points ran again;
    the job now at a finished point's old number overwrites its dir). Returns how many."""
    kept = 0
    for path in sorted(Path(root).glob(f"*/{ROW_FILE}")):
        try:
            row = read_row(path).iloc[0]
        except (OSError, ValueError, IndexError):
            continue
        if str(row.get("status")) == "ok" and isinstance(row.get("config_hash"), str):
            atomic_write_text(Path(root) / KEPT_DIR / f"{row['config_hash']}.csv", path.read_text())
            kept += 1
    return kept


def resume_state(
    job_dir: Path, fingerprint: str, timed: bool, kept: Path | None = None
) -> tuple[str, dict | None]:
    """What ``resume=true`` does with a point, from the row an earlier run left in its job dir:
    ``("done", row)`` an ok row for exactly this configuration, timed when the configuration
    times it: skipped; ``("continue", row)`` an ok check whose timing is pending or partial (the
    sweep was stopped in its rounds): the check is kept and only the missing rounds run;
    ``("run", None)`` anything else (no row, another configuration, a failure, damage): run it.
    ``kept``: where the sweep put its finished rows by configuration as it started
    (``keep_finished``): a point whose job number changed (a value added to a swept key
    renumbers the jobs) finds its finished row there, copied into its job dir."""
    path = job_dir / ROW_FILE
    elsewhere = None if kept is None else kept / f"{fingerprint}.csv"
    if elsewhere is not None and elsewhere.is_file() and not _matches(path, fingerprint):
        state, row = _state_of(elsewhere, fingerprint, timed)
        if state == "done":  # finished under another job number: its row, in this job's dir
            job_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_text(path, elsewhere.read_text())
            return state, row
    return _state_of(path, fingerprint, timed)


def _matches(path: Path, fingerprint: str) -> bool:
    try:
        return str(read_row(path)["config_hash"].iloc[0]) == fingerprint
    except (OSError, ValueError, KeyError, IndexError):
        return False


def _state_of(path: Path, fingerprint: str, timed: bool) -> tuple[str, dict | None]:
    """``resume_state`` of the row at ``path``."""
    if not path.exists():
        return "run", None
    try:
        row = read_row(path).to_dict("records")[0]
    except ValueError as e:  # damaged: run the point again
        log.warning(f"warning: {e}; running its point again")
        return "run", None
    row = {k: (None if isinstance(v, float) and v != v else v) for k, v in row.items()}
    if row.get("status") != "ok" or str(row.get("config_hash")) != fingerprint:
        return "run", None
    state = row.get("timing_state") or ("done" if row.get("latency_ms_median") is not None else "")
    if not timed or state == "done":
        return "done", row
    return "continue", row
