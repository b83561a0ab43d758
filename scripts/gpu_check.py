"""Validate mha-bench on a CUDA machine in short steps (``make gpu-check``; docs/measurements.md).

    python scripts/gpu_check.py [--steps timer,stability,main,long,llm,suite] [--out DIR]
    make gpu-check STEP=timer          # one step; STEP unset: every step in order

Each step runs what a GPU changes, checks it against its target, writes its figures to
``DIR/<gpu-name>/<step>/`` (default DIR: reports/examples; results.csv, the report, a
``summary.json`` with every target met or missed, the log) and prints one line per target.
``DIR/<gpu-name>/summary.json`` gathers the steps run so far, so steps can run one by one in
short GPU loans. Steps (each about 2 to 8 minutes on an H100; ``--limit`` caps one):

  timer      the harness timer against triton's do_bench and torch.utils.benchmark at GPU-sized
             points: harness / do_bench within 0.95-1.05 where the GPU sets the pace
  stability  make stability on CUDA: re-run coverage of the speedup intervals >= 90%, their
             median half-width <= 3%, a way made 1.2x slower (on the GPU) flagged at >= 7 of 8
  main       the GPU-sized main job (sweep=default): within 10 minutes, every point a verdict
  long       fused x manual/SDPA/FlexAttention at 4k and 8k tokens, E=2048, bfloat16, fwd and
             fwd_bwd, with and without a causal mask: each check within 1 s at L=8192
  llm        sweep=llm's CUDA shapes (Llama-sized heads, 8k prefill, a 4k window, decode against
             1k-32k caches): every point fits in memory, the float64 oracle included
  suite      the CUDA tests (every test with a CUDA case, a fake GPU or a GPU launcher) with the
             GPU visible: none fails, none is skipped for want of CUDA

On a machine without CUDA it says so in one line and exits 2. Exit 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STEPS = ("timer", "stability", "main", "long", "llm", "suite")
LIMIT_S = {  # each step's own cap: a GPU loan runs commands of at most 10 minutes
    "timer": 300,
    "stability": 480,
    "main": 600,
    "long": 420,
    "llm": 480,
    "suite": 480,
}
LONG = [
    "-m",
    "seq_len=4096,8192",
    "mask=none,causal",
    "mode=fwd,fwd_bwd",
    "variant=fused",
    "variant.attention=manual,sdpa,flex",
    "embed_dim=2048",
    "num_heads=16",
    "batch=2",
    "dtype=bfloat16",
]
CUDA_TESTS = sorted(  # every test file that has a CUDA case, a fake GPU or GPU launchers
    str(p.relative_to(REPO))
    for p in (REPO / "tests").glob("test_*.py")
    if re.search(r"cuda|gpu", p.read_text(), re.IGNORECASE)
)
FAILED = ("error", "crashed", "timeout")  # statuses that are no verdict on the way itself


@dataclass
class Target:
    """One figure against its target: ``met`` None when the step could not measure it."""

    name: str
    value: object
    target: str
    met: bool | None

    def line(self, step: str) -> str:
        mark = {True: "met", False: "MISSED", None: "not measured"}[self.met]
        return f"gpu-check {step}: {self.name}: {self.value} (target {self.target}) {mark}"


def slug(name: str) -> str:
    """``NVIDIA H100 80GB HBM3`` -> ``nvidia-h100-80gb-hbm3``: the folder of a GPU's figures."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "gpu"


def fraction(hits: int, n: int) -> str:
    return f"{hits}/{n}" + (f" ({100 * hits / n:.0f}%)" if n else "")


# -- targets: figures in, Targets out (tested on the CPU with made-up figures) ------------------


def timer_targets(fig: dict) -> list[Target]:
    """do_bench is the target (the same events and flush); torch.utils.benchmark synchronises
    after every call, so on CUDA it times what a waiting caller sees (host_ms_per_call), not the
    device time: its ratio is shown, not held to a band."""
    counted = [p for p in fig["points"] if not p["launch_bound"]]
    bench = [p["do_bench_ratio"] for p in counted if p["do_bench_ratio"] is not None]
    tub = [p["tub_ratio"] for p in counted]
    bound = [p["point"] for p in fig["points"] if p["launch_bound"]]
    return [
        Target(
            "harness / do_bench at GPU-bound points",
            _span(bench),
            "each within 0.95-1.05",
            all(0.95 <= r <= 1.05 for r in bench) if bench else None,
        ),
        Target(
            "harness / torch.utils.benchmark at GPU-bound points (info: it waits for each call)",
            _span(tub),
            "reported",
            True,
        ),
        Target(
            "launch-bound points (info: shown, not counted)",
            ", ".join(bound) or "none",
            "reported",
            True,
        ),
        Target(
            "repeatability (coefficient of variation of 5 medians)",
            f"{100 * fig['repeat_cv']:.2f}%",
            "<= 2%",
            fig["repeat_cv"] <= 0.02,
        ),
    ]


def stability_targets(fig: dict) -> list[Target]:
    cover = fig.get("speedup_coverage_pct")
    half = fig.get("median_speedup_rel_halfwidth_pct")
    flagged = fig.get("compare_slowed_flagged")
    same = fig.get("compare_same_code_regressions")
    hits, n = (int(x) for x in flagged.split("/")) if flagged else (None, None)
    regress, m = (int(x) for x in same.split("/")) if same else (None, None)
    return [
        Target(
            "speedup intervals covering the re-run",
            fig.get("speedup_coverage"),
            ">= 90%",
            None if cover is None else cover >= 90,
        ),
        Target(
            "median relative half-width of the speedup intervals",
            None if half is None else f"{half}%",
            "<= 3%",
            None if half is None else half <= 3,
        ),
        Target(
            "a way made 1.2x slower on the GPU: its points flagged by compare",
            flagged,
            ">= 7 of 8",
            None if hits is None else (n > 0 and hits >= 7 * n / 8),
        ),
        Target(
            "same code compared with itself: regressions",
            same,
            "<= 1 of 32",
            None if regress is None else regress <= max(1, m // 32),
        ),
        Target(
            "rerun_noise measured (the CUDA default is 0.02)",
            fig.get("rerun_noise_measured"),
            "<= 0.02",
            None
            if fig.get("rerun_noise_measured") is None
            else fig["rerun_noise_measured"] <= 0.02,
        ),
    ]


def sweep_targets(step: str, rows: list[dict], wall_s: float, limit_s: float) -> list[Target]:
    """What every sweep step asks, and each one's own target."""
    statuses: dict[str, int] = {}
    for r in rows:
        statuses[r["status"]] = statuses.get(r["status"], 0) + 1
    failed = sum(statuses.get(s, 0) for s in FAILED)
    pending = sum(1 for r in rows if r.get("timing_state") in ("pending", "partial"))
    out = [
        Target(
            "points with a verdict",
            ", ".join(f"{n} {s}" for s, n in sorted(statuses.items())) or "no rows",
            f"every point ok, mismatch, unsupported or invalid ({failed} failed)",
            bool(rows) and failed == 0,
        ),
        Target(
            "timed to the end",
            f"{len(rows) - pending}/{len(rows)} rows",
            "no point pending or partial",
            bool(rows) and pending == 0,
        ),
        Target("wall time", f"{wall_s:.0f} s", f"<= {limit_s:.0f} s", wall_s <= limit_s),
    ]
    bound = [r for r in rows if str(r.get("launch_bound")).lower() == "true"]
    timed = [r for r in rows if str(r.get("launch_bound")).lower() in ("true", "false")]
    out.append(
        Target(
            "launch-bound points (info: latency is the host's pace there)",
            f"{len(bound)}/{len(timed)}",
            "reported",
            True,
        )
    )
    if step == "main":
        out[2] = Target("wall time", f"{wall_s:.0f} s", "<= 600 s (10 minutes)", wall_s <= 600)
    if step == "long":
        at = [_float(r.get("check_s")) for r in rows if _float(r.get("seq_len")) == 8192]
        at = [x for x in at if x is not None]
        out.append(
            Target(
                "check time per point at L=8192 (the oracle's share included)",
                f"max {max(at):.2f} s over {len(at)} points" if at else "none checked",
                "<= 1 s",
                max(at) <= 1.0 if at else None,
            )
        )
    if step == "llm":
        oom = statuses.get("oom", 0)
        out.append(Target("points out of memory", oom, "0 (the float64 oracle included)", oom == 0))
    return out


def suite_targets(log: str) -> list[Target]:
    m = re.search(r"=+ (.*?) in [\d.]+s", log)
    summary = m.group(1) if m else "no pytest summary line"
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|errors?|skipped)", summary)}
    cuda_skips = len(re.findall(r"SKIPPED.*needs CUDA", log))
    return [
        Target(
            "tests",
            summary,
            "none failed",
            None if not m else counts.get("failed", 0) + counts.get("error", 0) == 0,
        ),
        Target("CUDA tests skipped for want of CUDA", cuda_skips, "0", cuda_skips == 0),
    ]


def _span(values: list[float]) -> str:
    if not values:
        return "none"
    return f"{min(values):.3f}-{max(values):.3f} over {len(values)} points"


def _float(value):
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


# -- running a step -----------------------------------------------------------------------------


def run(cmd: list[str], log: Path, limit_s: float, cwd: Path = REPO) -> tuple[int, float]:
    """Run ``cmd`` with its output in ``log`` (and echoed), stopped by SIGTERM at ``limit_s``
    (a sweep then gathers what it finished: its rows are kept), SIGKILL 60 s later."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(
            cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
        )
        deadline = t0 + limit_s
        stopped = False
        for line in proc.stdout:  # the step's progress, as it goes
            f.write(line)
            sys.stdout.write(line)
            if not stopped and time.perf_counter() > deadline:
                proc.send_signal(signal.SIGTERM)
                stopped = True
        try:
            rc = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
    return rc, time.perf_counter() - t0


def sweep_step(step: str, args: list[str], where: Path, limit_s: float) -> list[Target]:
    work = where / "sweep"
    shutil.rmtree(work, ignore_errors=True)
    cmd = [sys.executable, "-m", "harness", *args, f"hydra.sweep.dir={work}"]
    cmd.append(f"report_dir={where}")
    _, wall = run(cmd, where / "log.txt", limit_s)
    rows = _rows(work / "results.csv")
    for name in ("results.csv", "ranking.csv", "effects_summary.csv"):
        if (work / name).exists():
            shutil.copy(work / name, where / name)
    for html in where.glob("*.html"):  # the report (named after the sweep's folder): one name
        if html.name != "report.html":
            html.replace(where / "report.html")
    shutil.rmtree(work, ignore_errors=True)  # traces and per-point logs stay out of the example
    return sweep_targets(step, rows, wall, limit_s)


def _rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    import csv

    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def step_targets(step: str, where: Path, limit_s: float) -> list[Target]:
    py = sys.executable
    if step == "timer":
        out = where / "timer.json"
        run([py, "scripts/validate_timer.py", "--json", str(out)], where / "log.txt", limit_s)
        return timer_targets(json.loads(out.read_text())) if out.exists() else _unmeasured()
    if step == "stability":
        work = where / "runs"
        shutil.rmtree(work, ignore_errors=True)
        run(
            [py, "scripts/stability.py", "--gap", "15", "--out", str(work)],
            where / "log.txt",
            limit_s,
        )
        fig = work / "stability.json"
        if fig.exists():
            shutil.copy(fig, where / "stability.json")
            shutil.copy(work / "A" / "results.csv", where / "results.csv")
        shutil.rmtree(work, ignore_errors=True)
        return stability_targets(json.loads(fig.read_text())) if fig.exists() else _unmeasured()
    if step == "main":
        return sweep_step(step, ["sweep=default"], where, limit_s)
    if step == "long":
        return sweep_step(step, LONG, where, limit_s)
    if step == "llm":
        return sweep_step(step, ["sweep=llm"], where, limit_s)
    if step == "suite":
        # The tests that take another path on CUDA, with the GPU visible (the whole suite is
        # `make test`; it runs on any machine).
        cmd = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *CUDA_TESTS]
        cmd += [
            "-k",
            "cuda or gpu or CUDA or GPU or launch or clock or nvml or cupti or oracle_blocks "
            "or window_mask or decode_finding",
        ]
        if _has("xdist"):
            cmd += ["-n", str(min(8, os.cpu_count() or 1))]
        run(cmd, where / "log.txt", limit_s)
        return suite_targets((where / "log.txt").read_text())
    raise ValueError(step)


def _unmeasured() -> list[Target]:
    return [Target("the step's figures", "none: it failed or ran out of time", "written", False)]


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def write_summary(root: Path, step: str, targets: list[Target], info: dict) -> dict:
    """The step's summary.json, and the GPU's summary.json with this step's entry replaced."""
    entry = dict(
        step=step,
        **info,
        met=all(t.met is not False for t in targets),
        targets=[asdict(t) for t in targets],
    )
    (root / step).mkdir(parents=True, exist_ok=True)
    (root / step / "summary.json").write_text(json.dumps(entry, indent=1, default=str) + "\n")
    overall = root / "summary.json"
    every = json.loads(overall.read_text()) if overall.exists() else {"steps": {}}
    every["steps"][step] = entry
    every["device_name"] = info.get("device_name")
    every["steps"] = {s: every["steps"][s] for s in STEPS if s in every["steps"]}
    overall.write_text(json.dumps(every, indent=1, default=str) + "\n")
    return entry


def machine_info() -> dict:
    import torch

    props = torch.cuda.get_device_properties(0)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    return dict(
        device_name=torch.cuda.get_device_name(0),
        memory_gib=round(props.total_memory / 2**30, 1),
        l2_mib=round(getattr(props, "L2_cache_size", 0) / 2**20, 1),
        torch=torch.__version__,
        cuda=torch.version.cuda,
        cpus=os.cpu_count(),
        git_commit=commit or None,
        date=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    )


def missing_modules() -> list[str]:
    """What the harness needs beyond torch: a bare GPU image often lacks Hydra."""
    need = {"hydra": "hydra-core", "omegaconf": "omegaconf", "pandas": "pandas", "jinja2": "jinja2"}
    return [pkg for mod, pkg in need.items() if not _has(mod)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--steps", default=",".join(STEPS), help="comma-separated: " + ",".join(STEPS)
    )
    parser.add_argument("--out", default=str(REPO / "reports" / "examples"))
    parser.add_argument("--limit", type=float, default=None, help="seconds per step (a cap)")
    args = parser.parse_args(argv)
    steps = [s for s in args.steps.split(",") if s]
    unknown = [s for s in steps if s not in STEPS]
    if unknown:
        print(f"gpu-check: unknown step {unknown[0]!r}; steps are {', '.join(STEPS)}")
        return 2
    import torch

    if not torch.cuda.is_available():
        print(
            f"gpu-check: no CUDA device here (torch {torch.__version__} sees none); "
            "run it on a machine with an NVIDIA GPU"
        )
        return 2
    missing = missing_modules()
    if missing:
        print(
            f"gpu-check: {', '.join(missing)} not installed; run `make setup` first "
            "(it keeps the installed torch)"
        )
        return 2
    info = machine_info()
    root = Path(args.out) / slug(info["device_name"])
    missed = 0
    for step in steps:
        where = root / step
        where.mkdir(parents=True, exist_ok=True)
        limit = min(args.limit or LIMIT_S[step], LIMIT_S[step])
        print(f"gpu-check {step}: running (at most {limit:.0f} s) on {info['device_name']}")
        t0 = time.perf_counter()
        targets = step_targets(step, where, limit)
        entry = write_summary(root, step, targets, {**info, "wall_s": time.perf_counter() - t0})
        for t in targets:
            print(t.line(step), flush=True)
        missed += not entry["met"]
    met = len(steps) - missed
    print(f"gpu-check: {met}/{len(steps)} steps met every target; figures in {root}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
