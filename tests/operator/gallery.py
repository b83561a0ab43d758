"""Issue 58's operator gallery: what an operator does (a closed pipe, a full disk, a read-only
dir, SIGINT, SIGTERM, SIGHUP, SIGKILL) at each moment of a sweep (the checks, the rounds, the
gather, the rendering), as tests/faulty/ is for variants. Each case asserts the documented exit
code, one line saying why (none for a closed pipe or SIGKILL; no traceback), the rows kept, and
that ``resume=true`` then ends with every point once, checked and timed, and the report.
act.py does the action from inside the sweep's process at that moment, so each case happens
every time. The cases are in tests/test_operator_signals.py and tests/test_operator_files.py
(two files: pytest-xdist gives each file one worker)."""

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from tests.conftest import harness_env

ACT = Path(__file__).parent / "act.py"
# one shape, three ways: one block, timed together after the last check
SWEEP = ["-m", "variant=fused,separate,reference", "batch=1", "seq_len=8", "embed_dim=16",
         "num_heads=2", "timing.warmup=0", "timing.rounds=4", "timing.round_time=0.05",
         "timing.resident_mb=0", "num_threads=1", "hydra.sweep.dir=sweep"]  # fmt: skip
MOMENTS = ("checks", "rounds", "gather", "rendering")
# action: (exit code, what its one line says; None: no line)
ACTIONS = {
    "pipe": (0, None),  # the rows, results.csv and the report are files: the sweep goes on
    "SIGINT": (130, "SIGINT|interrupted"),
    "SIGTERM": (143, "SIGTERM"),
    "SIGHUP": (129, "SIGHUP"),
    "SIGKILL": (-signal.SIGKILL, None),  # nothing runs after it: resume finishes
    "disk": (3, "No space left on device"),
    "readonly": (3, "Permission denied"),
}
# a few cases in make test (each a sweep and its resume, about 15 s), the rest in make test-slow
QUICK = {("SIGTERM", "gather"), ("disk", "rounds")}


def cases(actions, moments=MOMENTS) -> list:
    """The matrix's cases for ``actions``, each at every moment; all but QUICK marked slow."""
    return [
        pytest.param(a, m, marks=() if (a, m) in QUICK else pytest.mark.slow, id=f"{a}-{m}")
        for a in actions
        for m in moments
    ]


# the sweep's progress and its results' lines; anything else on stderr is a thing said
PROGRESS = ("[", "sweep:", "measured peak:", "rounds:", "round ", "results:", "ranking:",
            "timing:", "report:", "effects:", "finding:")  # fmt: skip


def _undone(action: str, where: Path):
    """Undo what the action left (a full disk, a read-only dir), as the operator would before
    resuming."""
    if action == "disk":
        (where / "filler").unlink(missing_ok=True)
    elif action == "readonly":
        for top, _, _ in os.walk(where):
            os.chmod(top, os.stat(top).st_mode | 0o200)


def _prepared(action: str, where: Path) -> list[str]:
    """The command's prefix for the action (root's power to write anywhere given up), or a
    skip when this machine cannot do the action."""
    if action == "disk":
        if os.geteuid() != 0 or shutil.which("mount") is None:
            pytest.skip("a full disk on demand needs root to mount a small tmpfs")
        if subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(where)]
        ).returncode:
            pytest.skip("this machine refused to mount a tmpfs")
    if action == "readonly" and os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("root writes to a read-only dir; setpriv (util-linux) takes that away")
        return ["setpriv", "--bounding-set", "-dac_override,-dac_read_search,-fowner"]
    return []


def said_of(stderr: str) -> list[str]:
    return [x for x in stderr.splitlines() if x.strip() and not x.startswith(PROGRESS)]


def _rows(sweep: Path) -> pd.DataFrame:
    """The rows on disk: results.csv when it was written, else the job dirs' own rows."""
    if (sweep / "results.csv").exists():
        return pd.read_csv(sweep / "results.csv")
    rows = [pd.read_csv(p) for p in sorted(sweep.glob("*/result.csv"))]
    return pd.concat(rows) if rows else pd.DataFrame(columns=["variant", "status"])


def case(tmp_path: Path, action: str, moment: str) -> None:
    """The action at the moment, then resume=true: see the module's docstring."""
    where = tmp_path / "w"
    where.mkdir()
    prefix = _prepared(action, where)
    env = harness_env(ACT_MOUNT=str(where), ACT_DIR=str(where / "sweep"))
    try:
        proc = subprocess.run(
            [*prefix, sys.executable, str(ACT), action, moment, *SWEEP],
            cwd=where, env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        code, cause = ACTIONS[action]
        said = said_of(proc.stderr)
        assert proc.returncode == code, proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
        if cause is None:
            assert said == [], said
        else:  # one line naming the cause
            assert len(said) == 1 and any(c in said[0] for c in cause.split("|")), said
        kept = _rows(where / "sweep")
        assert kept["status"].eq("ok").all(), kept[["variant", "status"]]
        if action == "pipe" or (action.startswith("SIG") and action != "SIGKILL" and
                                moment in ("gather", "rendering")):  # fmt: skip
            assert len(kept) == 3 and (where / "sweep" / "report.html").exists(), proc.stderr
        if moment not in ("checks", "composing"):
            assert len(kept) == 3, kept  # every point was checked before this moment
        _undone(action, where)
        again = subprocess.run(
            [sys.executable, "-m", "harness", *SWEEP, "resume=true"],
            cwd=where, env=harness_env(), capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert again.returncode == 0 and said_of(again.stderr) == [], again.stderr[-3000:]
        rows = pd.read_csv(where / "sweep" / "results.csv")
        assert sorted(rows["variant"]) == ["fused", "reference", "separate"], rows
        shown = [
            c for c in ("variant", "status", "latency_ms_median", "contended", "error") if c in rows
        ]
        assert rows["status"].eq("ok").all() and rows["latency_ms_median"].notna().all(), (
            rows[shown].to_string(),
            again.stderr[-3000:],
        )
        # what the first run checked is not checked again
        assert again.stdout.count("skipped") + again.stdout.count("check kept") >= len(kept)
        assert (where / "sweep" / "report.html").exists()
    finally:
        _undone(action, where)
        if action == "disk":  # the sweep's files go with it
            subprocess.run(["umount", str(where)])
