"""Is anything lost when a sweep is stopped? Kills the main job and resumes it (``make interrupt``).

    python scripts/interrupt.py [--out DIR] [--preset NAME] [--kill-after-round K]
        [--term-after N] [overrides ...]

Runs the main job (``sweep=default`` unless ``--preset``) into a work dir, as a user would:

- A: uninterrupted, the yardstick: its wall time and its intervals.
- B: SIGKILLed as soon as its progress says round K has ended (default 3): the check verdicts on
  disk then (target: every point's), and the repetitions in its journal. Then resumed with
  ``resume=true`` into the same dir: its wall time against A's (target: at most 40%), the
  checks it redid (target: none), and whether its intervals cover run A's figures (target: at
  least 90% of points; the same test as ``make stability``).
- C: SIGTERMed in its check phase once N points have been checked (default 40): its exit code
  (target: 143) and a row in results.csv for every point it had checked.

Printed and written to ``<out>/interrupt.json``; each run's output is in ``<out>/<run>.log``.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pandas as pd

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
from harness.envinfo import python_env  # noqa: E402
from harness.measure.journal import JOURNAL_FILE  # noqa: E402
from harness.results import read_csv  # noqa: E402
from harness.progress import headline  # noqa: E402
from stability import coverage, write_figures  # noqa: E402

CHECKED_LINE = re.compile(
    r"^\[\s*\d+/\d+ .*\] (ok|mismatch) "
)  # a point's progress line after its check


def start(out: Path, name: str, args: list[str]) -> tuple[subprocess.Popen, float]:
    cmd = [
        sys.executable,
        "-m",
        "harness",
        *args,
        f"hydra.sweep.dir={out / name}",
        f"report_dir={out / 'reports'}",
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=out,
        env=python_env(REPO),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        bufsize=1,
    )
    proc.log_path = out / f"{name.split()[0]}.log"  # what it printed, kept beside its dir
    return proc, time.perf_counter()


def finish(
    proc: subprocess.Popen, t0: float, name: str, lines: list[str]
) -> tuple[int, float, str]:
    rest, err = proc.communicate(timeout=3600)
    lines.extend(rest.splitlines())
    wall = time.perf_counter() - t0
    with open(proc.log_path, "a") as log:
        log.write("\n".join(lines) + "\n" + err)
    print(f"run {name}: exit {proc.returncode}, {wall:.1f} s", flush=True)
    return proc.returncode, wall, err


def run_until(
    out: Path, name: str, args: list[str], stop_when, sig: int
) -> tuple[int, list[str], str, float]:
    """Run a sweep and send ``sig`` once ``stop_when(line, lines)`` is true for a line of its
    output."""
    proc, t0 = start(out, name, args)
    lines: list[str] = []
    for line in proc.stdout:
        lines.append(line.rstrip("\n"))
        if stop_when(lines[-1], lines):
            proc.send_signal(sig)
            print(
                f"run {name}: {signal.Signals(sig).name} "
                f"after {time.perf_counter() - t0:.1f} s at: {lines[-1][:90]}",
                flush=True,
            )
            break
    code, wall, err = finish(proc, t0, name, lines)
    return code, lines, err, wall


def verdicts_on_disk(sweep: Path) -> int:
    """Job dirs whose row holds a check verdict (status ok or mismatch)."""
    n = 0
    for path in sweep.glob("*/result.csv"):
        n += read_csv(path)["status"].isin(["ok", "mismatch"]).any()
    return int(n)


def main() -> int:
    parser = argparse.ArgumentParser(description=headline(__doc__))
    parser.add_argument(
        "--out", default=None, help="work dir (default: results/interrupt/<date_time>)"
    )
    parser.add_argument("--preset", default="default", help="conf/sweep preset (default: default)")
    parser.add_argument(
        "--kill-after-round", type=int, default=3, help="run B: SIGKILL when this round ends"
    )
    parser.add_argument(
        "--term-after", type=int, default=40, help="run C: SIGTERM after this many checked points"
    )
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run")
    args = parser.parse_args()
    out = Path(
        args.out or REPO / "results" / "interrupt" / datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    ).resolve()
    out.mkdir(parents=True, exist_ok=True)
    sweep = [f"sweep={args.preset}", *args.overrides]

    # A: the uninterrupted yardstick.
    proc, t0 = start(out, "A", sweep)
    lines_a: list[str] = []
    code_a, wall_a, err = finish(proc, t0, "A", lines_a)
    if code_a != 0:
        sys.exit(f"interrupt: run A failed (exit {code_a}):\n{err[-3000:]}")
    a = read_csv(out / "A" / "results.csv")
    points = len(a)

    # B: SIGKILL once round K has ended, then resume.
    marker = f"round {args.kill_after_round}/"
    code_b, lines_b, _, wall_b = run_until(
        out, "B", sweep, lambda line, _: line.startswith(marker), signal.SIGKILL
    )
    kept = verdicts_on_disk(out / "B")
    journal = out / "B" / JOURNAL_FILE
    repetitions = (
        sum(1 for line in journal.read_text().splitlines() if '"ms"' in line)
        if journal.exists()
        else 0
    )
    proc, t0 = start(out, "B", [*sweep, "resume=true"])
    lines_r: list[str] = []
    code_r, wall_r, err = finish(proc, t0, "B resumed", lines_r)
    if code_r != 0:
        sys.exit(f"interrupt: resumed run B failed (exit {code_r}):\n{err[-3000:]}")
    b = read_csv(out / "B" / "results.csv")
    spans: dict[
        str, list[float]
    ] = {}  # the journal's repetitions by run: how long each run's rounds took
    for line in journal.read_text().splitlines():
        record = json.loads(line) if '"at"' in line else None
        if record:
            spans.setdefault(record["run"], []).append(record["at"])
    resumed_rounds_s = max(spans[max(spans)]) - min(spans[max(spans)]) if spans else float("nan")
    rechecked = sum(1 for line in lines_r if CHECKED_LINE.match(line) and "check kept" not in line)
    hits, n, _ = coverage(a, b, "speedup", "speedup_ci_low", "speedup_ci_high")
    lat_hits, lat_n, _ = coverage(
        a, b, "latency_ms_median", "latency_ms_ci_low", "latency_ms_ci_high"
    )

    # C: SIGTERM in the check phase.
    code_c, lines_c, _, wall_c = run_until(
        out,
        "C",
        sweep,
        lambda line, lines: sum(1 for x in lines if CHECKED_LINE.match(x)) >= args.term_after,
        signal.SIGTERM,
    )
    checked_c = sum(1 for line in lines_c if CHECKED_LINE.match(line))
    c = (
        read_csv(out / "C" / "results.csv")
        if (out / "C" / "results.csv").exists()
        else pd.DataFrame()
    )
    rows_c = int(c["status"].isin(["ok", "mismatch"]).sum()) if len(c) else 0

    figures = {
        "points": points,
        "A_wall_s": round(wall_a, 1),
        "B_killed_after_round": args.kill_after_round,
        "B_exit": code_b,
        "B_verdicts_kept": f"{kept}/{points}",
        "B_repetitions_journaled": repetitions,
        "B_resume_wall_s": round(wall_r, 1),
        "B_resume_pct_of_A": round(100 * wall_r / wall_a, 1),
        "B_resume_rounds_s": round(resumed_rounds_s, 1),  # its missing rounds alone
        "B_resume_rounds_pct_of_A": round(100 * resumed_rounds_s / wall_a, 1),
        "B_resume_checks_redone": rechecked,
        "B_resume_rows_ok": f"{int((b['status'] == 'ok').sum())}/{len(b)}",
        "B_resume_rounds_done": f"{int((b['timing_state'] == 'done').sum())}/{len(b)}",
        "B_speedup_covers_A": f"{hits}/{n}",
        "B_speedup_covers_A_pct": round(100 * hits / n, 1) if n else None,
        "B_latency_covers_A": f"{lat_hits}/{lat_n}",
        "B_latency_covers_A_pct": round(100 * lat_hits / lat_n, 1) if lat_n else None,
        "C_terminated_after_checks": args.term_after,
        "C_exit": code_c,
        "C_points_checked": checked_c,
        "C_rows_with_verdict": rows_c,
        "C_wall_s": round(wall_c, 1),
        "overrides": args.overrides,
        "dir": str(out),
    }
    write_figures(figures, out / "interrupt.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
