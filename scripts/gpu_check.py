"""Validate mha-bench on a CUDA machine in short steps (``make gpu-check``; docs/measurements.md).

    python scripts/gpu_check.py [--steps probe,timer,main,...] [--out DIR] [--limit S]
    make gpu-check STEP=probe          # one step (or a comma list; llm: its three steps);
                                       # STEP unset: every step in order

Each step runs what a GPU changes, checks it against its target, writes its figures to
``DIR/<gpu-name>/<step>/`` (default DIR: reports/examples; results.csv, the report, a
``summary.json`` with every target met or missed, the log) and prints one line per target.
``DIR/<gpu-name>/summary.json`` gathers the steps run so far, so steps can run one by one in
short GPU loans. Steps, in this order (each capped at 6 minutes or less, ``LIMIT_S``; the
first two, probe and timer, are 9 minutes of caps together, before the install and the start):

  probe        scripts/gpu_probe.py (at most 4 minutes): the graph-replay timing on a real GPU
               before the longer steps rely on it: at the main job's largest shapes the memory a
               captured point holds against the budget's estimate (never more), and the same
               points waiting together in one graph pool against alone; a call that
               cannot be captured, then a good point, in one process (events timing and its own
               error, then a replay; both ok); an L2-resident decode's eager time against the
               flushed and the warm replay, and its launch_bound
  timer        scripts/validate_timer.py at GPU-sized points, each time a row records held
               against a timer that takes it the same way: the device time (the call captured
               once in a CUDA graph, replayed after the L2 flush) / a graph benchmark that clears
               the cache the same way, and the warm replay / triton's do_bench_cudagraph, within
               0.95-1.05 at every point; the eager time as sweeps take it / torch.utils.benchmark
               within 0.9-1.1 at every point; the flushed eager time / do_bench within 0.95-1.05
               where the GPU sets the pace (launch_bound: eager >= harness.schema.LAUNCH_BOUND x
               warm replay); repeatability <= 2%
  main         the GPU-sized main job (sweep=default's cuda_params, one head merge: view; the
               reshape merge runs the same kernels and ties with it, so with both no way could
               clear its twin): every point a verdict within the cap; on GPU-bound points
               (launch_bound False) the median relative half-width of the latency and of the
               speedup intervals <= 3%; a winner named at >= 2 of its 4 shapes, or why not
  stability    make stability on CUDA: re-run coverage of the speedup intervals >= 90%, their
               median half-width <= 3%, a way made 1.2x slower (on the GPU) flagged at >= 7 of 8;
               the earned floor stored for cuda, harness/floors.json copied beside the figures
               (floors.json: commit it as harness/floors.json)
  long         fused x manual/SDPA/FlexAttention at 8k tokens, E=2048, bfloat16, fwd and
               fwd_bwd, with and without a causal mask (12 points): each check within 1 s
               (the rows' check_s)
  models       sweep=models' CUDA sweeps (Llama-sized heads, bfloat16): ALiBi at 2k and 8k, sinks
               and 16 packed documents at 8k, decode of 8 sequences against 4k and 32k caches,
               static against paged (21 points, 4 FlexAttention compiles): every point ok, none
               out of memory (the float64 oracle is handed ALiBi and sinks a block at a time)
  llm_prefill  sweep=llm's CUDA sweeps one at a time (Llama-sized heads: E=4096, 32 heads of
  llm_window   128, bfloat16): the 8k prefill at 32, 8 and 1 K/V heads; the 4k window; decode
  llm_decode   against 1k and 32k caches (the preset's 1k-32k, its ends). Every point fits in
               memory, the float64 oracle included. ``--steps llm`` runs the three in order
  suite        the CUDA tests (every test with a CUDA case, a fake GPU or a GPU launcher) with the
               GPU visible: none fails, none is skipped for want of CUDA

How the sizes were estimated (H100 figures in docs/measurements.md, "NVIDIA H100 80GB HBM3"):
the timer step took 125 s with two timers per round; with six (eager, device flushed and not,
torch.utils.benchmark, do_bench, do_bench_cudagraph) at 0.5-1 s each: ~30 s a point, ~2.5 min.
The main job's 152 points took 333 s (84 s torch.compile's first calls, 70 s the rounds, ~1.2 s
a point the rest); one merge is 80 points, and timing device and eager time doubles the rounds:
~45 + 75 + 100 s, ~3.7 min. stability: 3 runs of 32 points at ~1.5 s a point plus start-up
and the 15 s gap, ~4.5 min (not yet run on a GPU). long: a first try checked 16 of 24 points in
170 s while each L=8192 check took up to 41 s (since fixed); 12 points at L=8192 with four
FlexAttention compiles of 15-30 s: ~3 min. llm: the 8k prefill is 30 points on 3 shapes (each
shape's float64 oracle, 2.2e12 FLOP, and a FlexAttention compile), ~4 min; the window 10
points on one shape, ~2 min; the preset's decode (96 points, 24 shapes, a FlexAttention compile
each) would take 6-10 min, so the step keeps its shortest and longest caches: 48 points, 12
shapes, ~4 min. suite: the CUDA test files under 8 workers, ~3 min.

Every step has a hard deadline, whether or not its command prints: its process group gets
SIGTERM ``GRACE_S`` before the cap (a sweep then writes the rows it has and its report) and
SIGKILL at the cap; the step's summary.json is still written, the figures it could not measure
``met: null`` and a ``deadline`` line saying when it was hit and what the command last printed.
On a machine without CUDA it says so in one line and exits 2. Exit 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STEPS = (
    "probe",
    "timer",
    "main",
    "stability",
    "long",
    "models",
    "llm_prefill",
    "llm_window",
    "llm_decode",
    "suite",
)
ALIASES = {"llm": ("llm_prefill", "llm_window", "llm_decode")}  # --steps llm: the three in order
LIMIT_S = {  # each step's own cap, its hard deadline (estimates in the module docstring)
    "probe": 240,
    "timer": 300,
    "main": 360,
    "stability": 360,
    "long": 300,
    "models": 360,
    "llm_prefill": 360,
    "llm_window": 240,
    "llm_decode": 360,
    "suite": 360,
}
FLOORS = REPO / "harness" / "floors.json"  # stability: the earned floors it writes (its copy)
GRACE_S = 30.0  # SIGTERM this long before the cap (a sweep writes what it has), SIGKILL at it
BAND = (0.95, 1.05)  # timer: harness / triton (or its rule), device time and eager time alike
TUB_BAND = (0.9, 1.1)  # timer: the eager time / torch.utils.benchmark (a host-timed loop)
HALF_WIDTH_PCT = 3.0  # main: median relative half-width on GPU-bound points
WINNERS = 2  # main: shapes with a named winner
MAIN = ["sweep=default", "variant.merge=view"]
LONG = [
    "-m",
    "seq_len=8192",
    "mask=none,causal",
    "mode=fwd,fwd_bwd",
    "variant=fused",
    "variant.attention=kernels()",
    "embed_dim=2048",
    "num_heads=16",
    "batch=2",
    "dtype=bfloat16",
]
# sweep=models' cuda_params: ALiBi, sinks, 16 packed documents at Llama-sized heads, decode static
# against paged (conf/sweep/models.yaml)
MODELS = ["sweep=models"]
LLM = REPO / "conf" / "sweep" / "llm.yaml"
# Each llm step runs one of the preset's cuda_params, with these overrides after its own.
LLM_SIZES = {"llm_decode": ["kv_cache_len=1024,32768"]}
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


def unmeasured(targets: list[Target]) -> list[Target]:
    """The same targets, none of them measured (a step stopped before writing its figures)."""
    return [replace(t, met=None) for t in targets]


# -- targets: figures in, Targets out (tested on the CPU with made-up figures) ------------------


def _in(band: tuple[float, float], value: float) -> bool:
    return band[0] <= value <= band[1]


def probe_targets(fig: dict) -> list[Target]:
    """gpu_probe's figures (``fig``: its --json; empty: nothing measured): the pool each captured
    point held against the budget's estimate, a failed capture followed by a good point in one
    process, an L2-resident decode's launch_bound."""
    pool = fig.get("pool") or []
    ratios = [r["held_mb"] / r["estimate_mb"] for r in pool if r.get("held_mb") is not None]
    capture = fig.get("capture") or []
    decode = fig.get("decode")
    misses = fig.get("misses")
    said = [m for m in misses or [] if m.startswith("capture")]
    together, alone = fig.get("block"), sum(r.get("held_mb") or 0 for r in pool)
    shared = together["held_mb"] / alone if together and alone else None
    return [
        Target(
            "memory a captured point holds / the budget's estimate (main job's largest shapes)",
            _span(ratios),
            "each <= 1",
            all(r <= 1 for r in ratios) if ratios and len(ratios) == len(pool) else None,
        ),
        Target(
            "memory the same points hold waiting together (one graph pool) / alone",
            "not measured" if shared is None else f"{shared:.3f}",
            "<= 1",
            None if shared is None else shared <= 1,
        ),
        Target(
            "a call not captured, then a good point, in one process",
            "; ".join(f"{r.get('label')}: {r.get('status')}, {r.get('timed_by')}" for r in capture)
            or "none",
            "events timing with its own error, then a replay; both ok",
            None if len(capture) < 2 or misses is None else not said,
        ),
        Target(
            "L2-resident decode: eager / flushed replay, eager / warm replay (info)",
            "none"
            if not decode
            else f"{_ratio_of(decode, 'latency_ms_median')}, "
            f"{_ratio_of(decode, 'replay_warm_ms_median')}; "
            f"launch_bound {decode.get('launch_bound')}",
            "launch_bound decided",
            None if not decode else decode.get("launch_bound") is not None,
        ),
    ]


def _ratio_of(row: dict, device: str) -> str:
    eager, other = _float(row.get("eager_ms_median")), _float(row.get(device))
    return f"{eager / other:.2f}x" if eager and other else "-"


def timer_targets(fig: dict) -> list[Target]:
    """Each time a row records against a timer that takes it the same way (validate_timer): the
    flushed replay against the cache-clearing graph benchmark and the warm replay against
    do_bench_cudagraph at every point; the eager time (no flush, as sweeps take it) against
    torch.utils.benchmark's blocks of back-to-back calls at every point; the flushed eager time
    against do_bench where the GPU sets the pace (do_bench times eager calls: at a launch-bound
    point both read the host's pace). ``fig``: validate_timer's --json (empty: nothing
    measured)."""
    points = fig.get("points") or []
    rule = fig.get("launch_bound_ratio")

    def ratios(key, among=points):
        return [p[key] for p in among if p.get(key) is not None]

    clear, warm = ratios("clear_graph_ratio"), ratios("cudagraph_ratio")
    refused = [
        f"{p['point']} ({p.get('capture_error') or p.get('cudagraph_error')})"
        for p in points
        if p.get("clear_graph_ratio") is None or p.get("cudagraph_ratio") is None
    ]
    tub = ratios("tub_ratio")
    bench = ratios("do_bench_ratio", [p for p in points if p.get("launch_bound") is not True])
    bound = [p["point"] for p in points if p.get("launch_bound") is True]
    cv = fig.get("repeat_cv")

    def held(name, values, band):
        return Target(
            name,
            _span(values),
            f"each within {band[0]:g}-{band[1]:g}",
            all(_in(band, r) for r in values) if values else None,
        )

    return [
        held(
            "harness device time (CUDA-graph replay, L2 flushed) / the cache-clearing graph "
            "benchmark, every point",
            clear,
            BAND,
        ),
        held("harness warm replay / do_bench_cudagraph, every point", warm, BAND),
        Target(
            "points without a graph ratio (not captured; their eager time kept)",
            "; ".join(refused) or "none",
            "none",
            None if refused or not points else True,
        ),
        held(
            "harness eager time (as sweeps take it) / torch.utils.benchmark, every point",
            tub,
            TUB_BAND,
        ),
        held("harness eager time, flushed / do_bench at GPU-bound points", bench, BAND),
        Target(
            f"launch-bound points (info: eager time >= {rule or 'LAUNCH_BOUND'}x warm replay)",
            ", ".join(bound) or "none",
            "reported",
            True if points else None,
        ),
        Target(
            "repeatability (coefficient of variation of 5 medians"
            + (f", {fig['repeat_of']})" if fig.get("repeat_of") else ")"),
            None if cv is None else f"{100 * cv:.2f}%",
            "<= 2%",
            None if cv is None else cv <= 0.02,
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


def _true(value) -> bool:
    return str(value).lower() == "true"


def _rel_half_widths(rows: list[dict], center: str, low: str, high: str) -> list[float]:
    out = []
    for r in rows:
        c, lo, hi = _float(r.get(center)), _float(r.get(low)), _float(r.get(high))
        if c and lo is not None and hi is not None and lo == lo and hi == hi:
            out.append((hi - lo) / 2 / c)
    return out


def main_targets(rows: list[dict], ranking: list[dict] | None) -> list[Target]:
    """The main job's own: narrow intervals where the GPU sets the pace (rows ok and not
    launch_bound; the speedup of the pairing reference itself, exactly 1, left out), and a
    winner named at ``WINNERS`` shapes or the reason at each shape without one
    (harness/report/ranking.py: a shape is a tie when another way's interval overlaps the
    best's)."""
    gpu_bound = [
        r for r in rows if r.get("status") == "ok" and str(r.get("launch_bound")) == "False"
    ]
    paired = [r for r in gpu_bound if r.get("label") != "reference"]
    out = []
    for what, sel, cols in (
        ("latency", gpu_bound, ("latency_ms_median", "latency_ms_ci_low", "latency_ms_ci_high")),
        ("speedup", paired, ("speedup", "speedup_ci_low", "speedup_ci_high")),
    ):
        rel = _rel_half_widths(sel, *cols)
        med = 100 * statistics.median(rel) if rel else None
        out.append(
            Target(
                f"median relative half-width of the {what} intervals at GPU-bound points",
                f"{med:.2f}% over {len(rel)} rows (max {100 * max(rel):.1f}%)"
                if rel
                else "no GPU-bound row with an interval",
                f"<= {HALF_WIDTH_PCT:g}%",
                None if med is None else med <= HALF_WIDTH_PCT,
            )
        )
    if ranking is None:
        out.append(Target("shapes with a winner", "no ranking.csv", f">= {WINNERS}", None))
        return out
    # a way, or a family of ways that tie among themselves and beat every other way (the
    # ranking's winner_factors: "structure=fused attention=sdpa", its merges tied)
    named = [r for r in ranking if r.get("winner") or r.get("winner_factors")]
    why = [
        f"{r.get('shape')}: a tie of {len(ways)} ways within the best's interval "
        f"({', '.join(ways[:3])}{', ...' if len(ways) > 3 else ''})"
        for r in ranking
        if not (r.get("winner") or r.get("winner_factors"))
        for ways in [[w for w in str(r.get("contenders") or "").split(";") if w]]
    ]
    out.append(
        Target(
            "shapes with a winner",
            f"{len(named)} of {len(ranking)}"
            + (
                ": "
                + "; ".join(
                    f"{r.get('shape')}: {r.get('winner') or r['winner_factors']}" for r in named
                )
                if named
                else ""
            )
            + (f"; no winner at {'; '.join(why)}" if why and len(named) < WINNERS else ""),
            f">= {WINNERS} of {len(ranking)}",
            len(named) >= WINNERS if ranking else None,
        )
    )
    return out


def sweep_targets(
    step: str,
    rows: list[dict],
    wall_s: float,
    limit_s: float,
    ranking: list[dict] | None = None,
) -> list[Target]:
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
    bound = [r for r in rows if _true(r.get("launch_bound"))]
    timed = [r for r in rows if str(r.get("launch_bound")).lower() in ("true", "false")]
    out.append(
        Target(
            "launch-bound points (info: eager time is the host's pace there)",
            f"{len(bound)}/{len(timed)}",
            "reported",
            True,
        )
    )
    if step == "main":
        out += main_targets(rows, ranking)
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
    if step == "models":  # the ways are ours: a mismatch on a GPU is a wrong way to fix
        ok = statuses.get("ok", 0)
        out.append(
            Target(
                "points that match nn.MultiheadAttention handed the same model",
                f"{ok}/{len(rows)} ok",
                "every point ok",
                bool(rows) and ok == len(rows),
            )
        )
    # every sweep step: a point out of memory is the budget's failure (issue 56: graphs' pools
    # not counted ended in oom rows that nothing flagged), the float64 oracle's included
    oom = statuses.get("oom", 0)
    out.append(Target("points out of memory", oom, "0 (the float64 oracle included)", oom == 0))
    timed = [r for r in rows if r.get("timed_by") not in (None, "", "wall")]
    unsaid = [
        str(r.get("label"))
        for r in timed
        if r.get("timed_by") != "graph" and not str(r.get("graph_error") or "").strip()
    ]
    graphs = sum(1 for r in timed if r.get("timed_by") == "graph")
    out.append(
        Target(
            "timed points replaying a CUDA graph, or saying why not",
            f"{graphs}/{len(timed)} replayed"
            + (f"; without a reason: {', '.join(unsaid[:3])}" if unsaid else ""),
            "every other one has its graph_error",
            None if not timed else not unsaid,
        )
    )
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


@dataclass
class Ran:
    """How a step's command ended: its exit status (negative: the signal that ended it), its
    wall time, and ``stopped``, the deadline's line when the deadline ended it (else None)."""

    rc: int
    wall_s: float
    stopped: str | None = None


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    """``sig`` to the command's process group (its own session: every process it started that
    did not leave it; the harness's worker dies with its parent)."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def run(
    cmd: list[str], log: Path, limit_s: float, cwd: Path = REPO, grace_s: float | None = None
) -> Ran:
    """Run ``cmd`` with its output in ``log`` (and echoed), in a process group of its own, under
    a watchdog that does not wait for it to print: SIGTERM to the group ``grace_s`` before
    ``limit_s`` (a sweep then gathers what it finished: its rows are kept), SIGKILL at
    ``limit_s``. Whatever is left of the group once its leader has exited is killed too."""
    grace = min(GRACE_S if grace_s is None else grace_s, limit_s / 2)  # a short cap: half
    term_at = limit_s - grace
    t0 = time.monotonic()
    last = {"line": "", "at": None}
    with open(log, "w") as f:
        proc = subprocess.Popen(
            cmd,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            bufsize=1,
            start_new_session=True,
        )

        def pump():  # the step's progress, as it goes; the watchdog does not wait for it
            try:
                for line in proc.stdout:
                    f.write(line)
                    f.flush()
                    sys.stdout.write(line)
                    sys.stdout.flush()
                    if line.strip():
                        last.update(line=line.strip(), at=time.monotonic())
            except (ValueError, OSError):  # the log closed under a straggler's last lines
                pass

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        stopped = None
        try:
            rc = proc.wait(timeout=term_at)
        except subprocess.TimeoutExpired:
            hit = time.monotonic() - t0
            said = (  # what it was doing: its last line before the deadline
                f"its last output {hit - (last['at'] - t0):.0f} s before: {last['line'][:160]!r}"
                if last["at"] is not None
                else "it had printed nothing"
            )
            _signal_group(proc, signal.SIGTERM)
            how = f"SIGTERM at {hit:.0f} s"
            try:
                rc = proc.wait(timeout=max(0.0, limit_s - (time.monotonic() - t0)))
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                rc = proc.wait()
                how += f", SIGKILL at {time.monotonic() - t0:.0f} s (SIGTERM did not end it)"
            stopped = f"hit ({limit_s:.0f} s cap): {how}; {said}"
        except BaseException:  # Ctrl-C here: its own session does not get it, so pass it on
            _signal_group(proc, signal.SIGTERM)
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
            _signal_group(proc, signal.SIGKILL)
            raise
        _signal_group(proc, signal.SIGKILL)  # stragglers of the group, if any
        reader.join(timeout=5)
        if not reader.is_alive():  # else a straggler outside the group holds the pipe: leave it
            proc.stdout.close()
    return Ran(rc, time.monotonic() - t0, stopped)


def deadline(ran: Ran, limit_s: float) -> list[Target]:
    """The deadline's line when it ended the step's command: the step missed its target."""
    if ran.stopped is None:
        return []
    return [Target("deadline", ran.stopped, f"the step ends within {limit_s:.0f} s", False)]


def llm_sweep(step: str, path: Path = LLM) -> dict[str, str]:
    """The one of sweep=llm's ``cuda_params`` that an llm step runs: decode (it sets
    kv_cache_len), window (mask=sliding) or prefill (the other)."""
    from omegaconf import OmegaConf

    sweeps = OmegaConf.to_container(OmegaConf.load(path).hydra.sweeper.cuda_params)
    sweeps = [sweeps] if isinstance(sweeps, dict) else list(sweeps)

    def part(sweep: dict) -> str:
        if "kv_cache_len" in sweep:
            return "llm_decode"
        return "llm_window" if str(sweep.get("mask")) == "sliding" else "llm_prefill"

    mine = [s for s in sweeps if part(s) == step]
    if len(mine) != 1:
        raise ValueError(f"{path.name}: {len(mine)} cuda_params sweeps for {step}, not one")
    return {str(k): str(v) for k, v in mine[0].items()}


def sweep_args(step: str) -> list[str]:
    """The harness's overrides for a sweep step. An llm step: the preset (its timing and other
    keys) with its union of sweeps turned off, and its one sweep given as overrides."""
    if step == "main":
        return MAIN
    if step == "long":
        return LONG
    if step == "models":
        return MODELS
    if step in ALIASES["llm"]:
        given = [f"{k}={v}" for k, v in llm_sweep(step).items()]
        off = ["hydra.sweeper.params=null", "hydra.sweeper.cuda_params=null"]
        return ["-m", "sweep=llm", *off, *given, *LLM_SIZES.get(step, [])]
    raise ValueError(step)


def command(step: str, where: Path) -> list[str]:
    """The command a step runs (in the repository, its output in ``where/log.txt``)."""
    py = sys.executable
    if step == "probe":
        return [py, "scripts/gpu_probe.py", "--json", str(where / "probe.json")]
    if step == "timer":
        return [py, "scripts/validate_timer.py", "--json", str(where / "timer.json")]
    if step == "stability":
        return [
            py,
            "scripts/stability.py",
            "--gap",
            "15",
            "--out",
            str(where / "runs"),
            "--store-floor",
            "--by",
            "make gpu-check STEP=stability",
        ]
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
        return cmd
    return [
        py,
        "-m",
        "harness",
        *sweep_args(step),
        f"hydra.sweep.dir={where / 'sweep'}",
        f"report_dir={where}",
    ]


def sweep_step(step: str, where: Path, limit_s: float) -> list[Target]:
    work = where / "sweep"
    shutil.rmtree(work, ignore_errors=True)
    ran = run(command(step, where), where / "log.txt", limit_s)
    rows = _rows(work / "results.csv") or _gathered(work)
    ranking = _rows(work / "ranking.csv") if (work / "ranking.csv").exists() else None
    for name in ("results.csv", "ranking.csv", "effects_summary.csv"):
        if (work / name).exists():
            shutil.copy(work / name, where / name)
    for html in where.glob("*.html"):  # the report (named after the sweep's folder): one name
        if html.name != "report.html":
            html.replace(where / "report.html")
    shutil.rmtree(work, ignore_errors=True)  # traces and per-point logs stay out of the example
    targets = sweep_targets(step, rows, ran.wall_s, limit_s, ranking)
    if not rows and ran.stopped:
        targets = unmeasured(targets)
    return targets + deadline(ran, limit_s)


def _gathered(work: Path) -> list[dict]:
    """The rows a sweep's jobs wrote, gathered here when it was killed before it gathered them
    itself (SIGKILL: no results.csv); written to its results.csv."""
    if not work.is_dir():
        return []
    try:
        if str(REPO) not in sys.path:
            sys.path.insert(0, str(REPO))
        import warnings

        from harness.results import gather

        with warnings.catch_warnings():  # pandas' notes on old rows' missing columns
            warnings.simplefilter("ignore")
            df = gather(work)
        if df.empty:
            return []
        df.to_csv(work / "results.csv", index=False)
    except Exception:  # damaged rows: the step reports what it has
        return []
    return _rows(work / "results.csv")


def _rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _figures(path: Path, ran: Ran, limit_s: float, targets_of, name: str) -> list[Target]:
    """A script step's targets from the JSON it wrote: each one unmeasured when it wrote none,
    and a miss of its own unless the deadline stopped it (then the deadline is the miss)."""
    if path.exists():
        fig = json.loads(path.read_text())
        cut = fig.get("complete") is False and not ran.stopped  # a crash half-way: say so
        return (
            targets_of(fig)
            + deadline(ran, limit_s)
            + [Target(path.name, f"incomplete (exit status {ran.rc}; see log.txt)", name, False)]
            * cut
        )
    missing = unmeasured(targets_of({}))
    if ran.stopped:
        return missing + deadline(ran, limit_s)
    return missing + [Target("the step's figures", f"none (exit status {ran.rc})", name, False)]


def step_targets(step: str, where: Path, limit_s: float) -> list[Target]:
    if step == "probe":
        ran = run(command(step, where), where / "log.txt", limit_s)
        return _figures(where / "probe.json", ran, limit_s, probe_targets, "probe.json written")
    if step == "timer":
        ran = run(command(step, where), where / "log.txt", limit_s)
        return _figures(where / "timer.json", ran, limit_s, timer_targets, "timer.json written")
    if step == "stability":
        work = where / "runs"
        shutil.rmtree(work, ignore_errors=True)
        ran = run(command(step, where), where / "log.txt", limit_s)
        fig = work / "stability.json"
        if fig.exists():
            shutil.copy(fig, where / "stability.json")
            if (work / "A" / "results.csv").exists():
                shutil.copy(work / "A" / "results.csv", where / "results.csv")
            if isinstance(json.loads(fig.read_text()).get("floor_stored"), dict):
                # the GPU's earned floor beside the others: copy it over harness/floors.json
                shutil.copy(FLOORS, where / "floors.json")
        shutil.rmtree(work, ignore_errors=True)
        return _figures(
            where / "stability.json", ran, limit_s, stability_targets, "stability.json written"
        )
    if step == "suite":
        ran = run(command(step, where), where / "log.txt", limit_s)
        return suite_targets((where / "log.txt").read_text()) + deadline(ran, limit_s)
    return sweep_step(step, where, limit_s)


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
    try:  # a copy of the tree without its .git, or a machine without git: no commit
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        commit = ""
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


def chosen_steps(text: str) -> tuple[list[str], str | None]:
    """``--steps``: the steps in the order given (``llm``: its three), or the unknown one."""
    steps: list[str] = []
    for s in (s for s in text.split(",") if s):
        if s not in STEPS and s not in ALIASES:
            return [], s
        steps += [t for t in ALIASES.get(s, (s,)) if t not in steps]
    return steps, None


def stability_first(steps: list[str], floor) -> tuple[list[str], str | None]:
    """``steps`` with ``stability`` before ``main`` where no CUDA floor is stored (``floor``:
    harness/floors.py's earned one, or None): main's intervals would rest on the assumed floor
    alone (0.02: a 3.92% half-width, over its 3% target before anything is measured). Returns
    the steps and the line that says so (None: unchanged)."""
    if floor is not None or "main" not in steps:
        return steps, None
    if "stability" in steps and steps.index("stability") < steps.index("main"):
        return steps, None
    rest = [s for s in steps if s != "stability"]
    at = rest.index("main")
    return rest[:at] + ["stability"] + rest[at:], (
        "gpu-check: no CUDA floor is stored in harness/floors.json: stability runs before main "
        "to earn one (its intervals would rest on the assumed 0.02 alone)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--steps",
        default=",".join(STEPS),
        help="comma-separated: " + ",".join(STEPS) + " (llm: the three llm_ steps)",
    )
    parser.add_argument("--out", default=str(REPO / "reports" / "examples"))
    parser.add_argument("--limit", type=float, default=None, help="seconds per step (a cap)")
    args = parser.parse_args(argv)
    steps, unknown = chosen_steps(args.steps)
    if unknown:
        print(
            f"gpu-check: unknown step {unknown!r}; steps are {', '.join(STEPS)} "
            f"(llm: {', '.join(ALIASES['llm'])})"
        )
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
    sys.path.insert(0, str(REPO))
    from harness import floors

    steps, said = stability_first(steps, floors.earned("cuda"))
    if said:
        print(said)
    info = machine_info()
    root = Path(args.out) / slug(info["device_name"])
    missed = 0
    for step in steps:
        where = root / step
        where.mkdir(parents=True, exist_ok=True)
        limit = min(args.limit or LIMIT_S[step], LIMIT_S[step])
        print(f"gpu-check {step}: running (at most {limit:.0f} s) on {info['device_name']}")
        t0 = time.perf_counter()
        try:
            targets = step_targets(step, where, limit)
        except Exception as e:  # gpu-check's own failure: the step's summary says so
            targets = [Target("the step", f"{type(e).__name__}: {e}", "runs", False)]
        entry = write_summary(root, step, targets, {**info, "wall_s": time.perf_counter() - t0})
        for t in targets:
            print(t.line(step), flush=True)
        missed += not entry["met"]
    met = len(steps) - missed
    print(f"gpu-check: {met}/{len(steps)} steps met every target; figures in {root}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
