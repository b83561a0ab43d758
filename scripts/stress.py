"""Stress: a 200-point tiny sweep on CPU must complete; prints the harness's per-point overhead
beyond the timed window (make stress).

overhead per point = (sweep wall time - sum of timing_s) / points: Hydra's composition and
bookkeeping, building the models, the check, the probe, writing the row, and the share of
start-up, peak measurement and report. Timing is kept short (3 rounds of 5 ms) so the
overhead dominates what is measured.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

REPO = Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--points", type=int, default=200)
    args = parser.parse_args()
    seeds = ",".join(str(i) for i in range(args.points))
    with tempfile.TemporaryDirectory() as tmp:
        sweep = Path(tmp) / "sweep"
        cmd = [
            sys.executable,
            "-m",
            "harness",
            "-m",
            f"seed={seeds}",
            "batch=1",
            "seq_len=16",
            "embed_dim=32",
            "num_heads=4",
            "timing.warmup=0.005",
            "timing.rounds=3",
            "timing.round_time=0.005",
            f"hydra.sweep.dir={sweep}",
            f"report_dir={tmp}/reports",
        ]
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            print(proc.stderr[-3000:], file=sys.stderr)
            return 1
        df = pd.read_csv(sweep / "results.csv")
    timed = df["timing_s"].sum()
    ok = int((df["status"] == "ok").sum())
    print(
        f"{len(df)} points ({ok} ok) in {wall:.1f} s; timed windows {timed:.1f} s; "
        f"overhead {(wall - timed) / len(df) * 1e3:.0f} ms per point beyond the timed window"
    )
    return 0 if len(df) == args.points and ok == args.points else 1


if __name__ == "__main__":
    sys.exit(main())
