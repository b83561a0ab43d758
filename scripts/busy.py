"""Does a busy machine pass for a result? (``make busy``)

    python scripts/busy.py [--trials 5] [--busy 2] [--out DIR] [--main] [overrides ...]

Each trial runs the same small sweep twice (``-m seq_len=128,512 variant=fused,separate``, or the
overrides given), A on the machine as it is, B with ``--busy`` processes spinning beside it, then
``mha-bench compare A B``: the verdicts it gives and its exit code (0 same, 1 regression,
3 not comparable). The target: never "regression" (docs/measurements.md, issue 54). With
``--main`` it also runs the main job (``sweep=default``) with the busy processes beside it and
prints its findings, the first of which must say the machine was busy (a ``num_threads=``
override given for the small sweep holds for it too). Written to
``<out>/busy.json``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SWEEP = ["-m", "seq_len=128,512", "variant=fused,separate"]
SPIN = "import time\nend = time.time() + {seconds}\nwhile time.time() < end:\n    pass\n"


@contextmanager
def busy(n: int, seconds: float = 3600):
    """``n`` processes spinning on the CPU for the duration (killed on the way out), each in a
    session of its own, as other users' jobs are: with the kernel's autogroup scheduling (on by
    default) the processes of one session share one fair share, so spinners started in this
    script's session would leave the sweep's worker (a session of its own) a whole core and
    contend with nothing."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", SPIN.format(seconds=seconds)], start_new_session=True
        )
        for _ in range(n)
    ]
    time.sleep(0.5)
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def sweep(out: Path, overrides: list[str]) -> tuple[int, str, float]:
    t0 = time.time()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "harness",
            *overrides,
            f"hydra.sweep.dir={out}",
            f"hydra.run.dir={out}",
            f"report_dir={out}",  # beside the sweep, not among the user's reports
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    if proc.returncode not in (0, 1):  # 1: a point not ok, said in its row; else no result
        sys.exit(
            f"busy: the sweep into {out} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}"
        )
    return proc.returncode, proc.stdout + proc.stderr, time.time() - t0


def load() -> float:
    return round(float(open("/proc/loadavg").read().split()[0]), 2)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--busy", type=int, default=2, help="busy processes beside run B")
    parser.add_argument("--out", default=None)
    parser.add_argument("--main", action="store_true", help="also the main job, busy")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    out = Path(args.out or REPO / "results" / f"busy-{datetime.now():%Y-%m-%d_%H-%M-%S}")
    out.mkdir(parents=True, exist_ok=True)
    overrides = args.overrides or SWEEP
    trials = []
    for i in range(args.trials):
        a, b = out / f"trial{i}" / "A", out / f"trial{i}" / "B"
        la = load()
        rc_a, _, sa = sweep(a, overrides)
        with busy(args.busy):
            lb = load()
            rc_b, _, sb = sweep(b, overrides)
        cmp = subprocess.run(
            [
                sys.executable,
                "-m",
                "harness.compare",
                str(a),
                str(b),
                "--out",
                str(out / f"trial{i}" / "compare.html"),
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
        )
        lines = cmp.stdout.splitlines()
        verdicts: dict[str, int] = {}
        for line in lines:
            word = line.split()[0] if line.split() else ""
            if line.startswith(("not comparable (", "not compared (")):
                word = line.split("(")[0].strip()
            elif word not in ("regression", "slower", "same", "faster", "reference"):
                continue
            verdicts[word] = verdicts.get(word, 0) + 1
        trial = {
            "trial": i,
            "load_a": la,
            "load_b": lb,
            "sweep_s": [round(sa), round(sb)],
            "sweep_rc": [rc_a, rc_b],
            "compare_rc": cmp.returncode,
            "verdicts": verdicts,
            "first_line": lines[0] if lines else "",
            "summary": next((x for x in lines if x.startswith("compared ")), ""),
        }
        trials.append(trial)
        print(json.dumps(trial), flush=True)
    result = {
        "date": f"{datetime.now():%Y-%m-%d %H:%M}",
        "busy": args.busy,
        "overrides": overrides,
        "trials": trials,
        "regressions": sum(t["verdicts"].get("regression", 0) for t in trials),
        "exit_codes": [t["compare_rc"] for t in trials],
    }
    if args.main:
        with busy(args.busy):
            # the machine's keys given for the small sweep (num_threads=2) hold for the main job too
            machine = [o for o in args.overrides if o.startswith("num_threads=")]
            rc, text, secs = sweep(out / "main", ["sweep=default", *machine])
        findings = [x for x in text.splitlines() if x.startswith("finding:")]
        result["main"] = {"rc": rc, "seconds": round(secs), "findings": findings}
        print("\n".join(findings))
    (out / "busy.json").write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"busy: {len(trials)} trials, {result['regressions']} regressions, compare exit codes "
        f"{result['exit_codes']}; {out / 'busy.json'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
