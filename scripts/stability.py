"""Do the figures survive a re-run? Runs one small sweep twice, minutes apart, plus once with one
way made 1.2x slower, and prints what a user would act on (``make stability``).

    python scripts/stability.py [--out DIR] [--gap SECONDS] [--preset NAME] [--no-slowdown]
        [--store-floor [--floors PATH] [--by TEXT] [--fresh-floor]] [overrides ...]

Default sweep: every variant x seq_len 128,512 x float32,bfloat16 x mask none,causal (8 shapes
x 4 ways = 32 points), with the config's timing defaults; on CUDA, sizes where the GPU sets the
pace (B=4, E=1024, 16 heads, seq_len 1024,4096 x float16,bfloat16). Runs A and B are the same
code; run C loads a sitecustomize that makes the fused variant's forward 1.2x slower (it waits
for a fifth of its own time: a host spin on the CPU, a GPU kernel on CUDA), everything else
unchanged (``--no-slowdown`` skips it; ``--preset default``
runs ``sweep=default`` instead of the small sweep). Printed and written to ``<out>/stability.json``:

- interval coverage: for every point measured in A and B, |speedup_A - speedup_B| <=
  sqrt(halfwidth_A^2 + halfwidth_B^2) (target: >= 90% of points), and the same for latency;
  the median relative half-width of the speedup intervals (target: <= 10%);
- rankings: shapes whose named winners agree, whose contender sets overlap, whose winners flip
  (both named and different), and where nn.MultiheadAttention is a contender although it is
  >= 1.5x slower than the best in both runs;
- A/B gate: ``harness.compare A B`` regressions (target: <= 1 of 32) and ``harness.compare A C``
  regressions among the slowed way's points (target: >= 7 of 8), with exit codes;
- the between-run spread the rounds of one run could not see, over d = log(speedup_B /
  speedup_A) with each row's floor taken out of its within-run part (``harness.floors.
  from_reruns``): the estimate sqrt((mean d^2 - mean within-run variance) / 2)
  (``rerun_noise_measured``) and its 90% upper bound (``rerun_noise_upper``), the floor a re-run
  earns. ``--store-floor`` writes that bound into ``harness/floors.json`` for the device kind,
  pooled with the same machine's earlier re-runs (the last ``floors.MAX_RUNS``;
  ``--fresh-floor`` forgets them), with the date and the machine (``make stability`` and
  ``make gpu-check STEP=stability`` pass it), and the harness's intervals use it from then on;
- effects (effects.csv): pairs of A and B whose ratios agree within their combined half-widths
  (target: >= 90%), the median half-width, the summaries' verdicts in both runs, and in run C
  how many pairs with the slowed way as the alternative say `slower`;
- wall time of each run, and the sum of its timed windows.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from harness import floors  # noqa: E402
from harness.measure import stats  # noqa: E402
from harness.measure.journal import Journal  # noqa: E402
from harness import config  # noqa: E402
from harness.envinfo import available_cores, python_env  # noqa: E402
from harness.report.compare import matched  # noqa: E402
from harness.results import SHAPE_KEYS  # noqa: E402
from harness.progress import headline  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SWEEP = ["-m", "variant=glob(*)", "seq_len=128,512", "dtype=float32,bfloat16", "mask=none,causal"]
# On CUDA the CPU's shapes are launch-bound (an H100 waits for Python's launches there): the same
# 8 shapes x 4 ways at sizes where the GPU sets the pace.
CUDA_SWEEP = [
    "-m",
    "variant=glob(*)",
    "seq_len=1024,4096",
    "dtype=float16,bfloat16",
    "mask=none,causal",
    "batch=4",
    "embed_dim=1024",
    "num_heads=16",
]
SLOW_VARIANT = "fused"
SLOWDOWN = """
# Loaded at start-up (sitecustomize) in run C only: the fused variant's forward takes 1.2x as long
# (it waits for a fifth of its own time after computing), as if a change had slowed it. On a CPU
# it spins on the host; on CUDA the wait is a GPU kernel (torch.cuda._sleep) of a fifth of the
# forward's device time: a host-side spin would hide in the queue of a GPU-bound point.
import time

import torch
import variants.fused as fused

_forward = fused.FusedQKVMHA.forward
_device_ms = {}  # the forward's device time per input shape: the least of its first calls
_cycles_per_ms = []


def _gpu_wait(ms):
    if not _cycles_per_ms:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1000)
        start.record()
        torch.cuda._sleep(10_000_000)
        end.record()
        end.synchronize()
        _cycles_per_ms.append(10_000_000 / start.elapsed_time(end))
    torch.cuda._sleep(max(1, int(ms * _cycles_per_ms[0])))


def _slowed_cuda(self, query, *args, **kwargs):
    key = (tuple(query.shape), query.dtype, torch.is_grad_enabled())
    seen = _device_ms.setdefault(key, [])
    if len(seen) < 5:  # warm-up calls: measure the forward itself (synchronised)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = _forward(self, query, *args, **kwargs)
        end.record()
        end.synchronize()
        seen.append(start.elapsed_time(end))
        return out
    out = _forward(self, query, *args, **kwargs)
    _gpu_wait(0.2 * min(seen))
    return out


def slowed(self, query, *args, **kwargs):
    if query.is_cuda:
        return _slowed_cuda(self, query, *args, **kwargs)
    t0 = time.perf_counter()
    out = _forward(self, query, *args, **kwargs)
    end = time.perf_counter() + 0.2 * (time.perf_counter() - t0)
    while time.perf_counter() < end:
        pass
    return out


fused.FusedQKVMHA.forward = slowed
"""


def sweep_for(overrides: list[str]) -> list[str]:
    """The small sweep at the CPU's or the GPU's sizes, by the device the runs will use."""
    device = next((o.split("=", 1)[1] for o in overrides if o.startswith("device=")), "auto")
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    return CUDA_SWEEP if device.startswith("cuda") else SWEEP


def run_sweep(
    out: Path, name: str, sweep: list[str], extra: list[str], paths: tuple = ()
) -> tuple[pd.DataFrame, float]:
    """Run one sweep into ``out/name`` (``paths`` go on PYTHONPATH, before the caller's own)."""
    t0 = time.perf_counter()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "harness",
            *sweep,
            *extra,
            f"hydra.sweep.dir={out / name}",
            f"report_dir={out / 'reports'}",
        ],
        cwd=out,
        env=python_env(*paths, REPO),
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"stability: run {name} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    print(f"run {name}: {wall:.1f} s", flush=True)
    return pd.read_csv(out / name / "results.csv"), wall


def coverage(
    a: pd.DataFrame, b: pd.DataFrame, center: str, low: str, high: str
) -> tuple[int, int, list[float]]:
    """Points whose two estimates agree within their combined 95% half-widths."""
    m = matched(a, b)  # one row of A to one of B: the same way at the same shape
    m = m[(m["status_a"] == "ok") & (m["status_b"] == "ok")]
    if center == "speedup":
        m = m[m["label_a"] != "reference"]  # exactly 1 by definition on both sides
    hits, rel = 0, []
    for r in m.to_dict("records"):
        ha = (r[f"{high}_a"] - r[f"{low}_a"]) / 2
        hb = (r[f"{high}_b"] - r[f"{low}_b"]) / 2
        hits += abs(r[f"{center}_a"] - r[f"{center}_b"]) <= math.hypot(ha, hb)
        rel += [ha / r[f"{center}_a"], hb / r[f"{center}_b"]]
    return hits, len(m), rel


def rerun_floor(a: pd.DataFrame, b: pd.DataFrame, floor: float) -> floors.Rerun:
    """The evidence of one re-run pair for the between-run floor: per point measured in both
    runs, d = log(speedup_B / speedup_A), the variance the rounds of each run predict, and its
    shape (the ways at a shape share their reference's offset); ``harness.floors.pooled`` turns
    it into (estimate, upper bound, points)."""
    m = matched(a, b)  # one row of A to one of B: the same way at the same shape
    m = m[(m["status_a"] == "ok") & (m["status_b"] == "ok") & (m["label_a"] != "reference")]
    d, within, shapes = [], [], []
    for r in m.to_dict("records"):
        d.append(math.log(r["speedup_b"] / r["speedup_a"]))
        shapes.append(tuple(str(r.get(f"{k}_a")) for k in SHAPE_KEYS))
        var = 0.0
        for s in ("a", "b"):
            half = math.log(r[f"speedup_ci_high_{s}"] / r[f"speedup_ci_low_{s}"]) / 2
            # half^2 = (t * se)^2 + (1.96 * floor)^2 (harness/measure/stats.py): take the floor out
            # (the row's own where it has one: measured per shape on CUDA)
            own = pd.to_numeric(r.get(f"rerun_noise_{s}"), errors="coerce")
            row_floor = floor if own is None or own != own else float(own)
            var += (
                max(0.0, half**2 - (stats.Z975 * row_floor) ** 2)
                / stats.t975(stats.rounds_df(int(r[f"n_samples_{s}"]))) ** 2
            )
        within.append(var)
    number = {shape: i for i, shape in enumerate(dict.fromkeys(shapes))}
    return floors.Rerun(
        measured=datetime.now().date().isoformat(),
        d=tuple(d),
        within=tuple(within),
        shapes=tuple(number[s] for s in shapes),
    )


def reread(run: Path) -> pd.DataFrame:
    """Run ``run``'s rows with their speedups recomputed from its journal (rounds.jsonl) by
    today's estimator (``stats.paired_ratio``) and each row's own floor: an earlier re-run pair
    stays evidence for the floor when the estimator changes. Each way pairs, round by round,
    with the nn.MultiheadAttention row at its shape (``SHAPE_KEYS``), clean rounds only."""
    rows = pd.read_csv(run / "results.csv", dtype={"config_hash": str})
    journal = Journal(run / "rounds.jsonl")
    by_hash = {key.split(":", 1)[-1]: journal.load(key) for key in journal.keys()}

    def clean(config_hash) -> dict:
        return {
            (x.run, x.round): x.ms for x in by_hash.get(str(config_hash), []) if not x.contended
        }

    def shape(r) -> tuple:
        return tuple(str(r.get(k)) for k in SHAPE_KEYS)

    refs = {
        shape(r): clean(r["config_hash"])
        for r in rows.to_dict("records")
        if r.get("label") == "reference"
    }
    for i, r in rows.iterrows():
        ref, mine = refs.get(shape(r)), clean(r["config_hash"])
        if r.get("label") == "reference" or not ref or r.get("status") != "ok":
            continue
        common = sorted(set(ref) & set(mine))
        iv = stats.paired_ratio(
            [ref[k] for k in common], [mine[k] for k in common], float(r["rerun_noise"])
        )
        rows.loc[i, ["speedup", "speedup_ci_low", "speedup_ci_high", "n_samples"]] = [
            iv.center,
            iv.low,
            iv.high,
            iv.n,
        ]
    return rows


def machine_of(rows: pd.DataFrame, kind: str) -> str:
    """What ran the re-runs, for floors.json: the GPU, or the CPU model and its cores."""
    names = rows.get("device_name")
    name = str(names.dropna().iloc[0]) if names is not None and names.notna().any() else kind
    return name if kind == "cuda" else f"{name}, {available_cores()} cores"


def store_floor(
    rows: pd.DataFrame, rerun: floors.Rerun, by: str, path: Path, fresh: bool
) -> dict | str:
    """Write the earned floor for the runs' device kind into ``path``: the upper bound over this
    re-run pooled with the machine's earlier ones (``harness.floors.earn``). The entry written
    (without its re-runs' points), or why none was."""
    if len(rerun.d) < floors.MIN_POINTS:
        points = len(rerun.d)
        return f"not stored: {points} points measured in both runs (at least {floors.MIN_POINTS})"
    kind = "cuda" if str(rows["device"].iloc[0]).startswith("cuda") else "cpu"
    floor = floors.earn(kind, rerun, machine_of(rows, kind), by, fresh=fresh, path=path)
    entry = {k: v for k, v in floor.entry().items() if k != "reruns"}
    return {"kind": kind, "path": str(path), "reruns_pooled": len(floor.reruns), **entry}


EFFECT_KEYS = ["factor", "baseline", "alternative", "context", "shape"]


def effects_agreement(a: Path, b: Path) -> dict:
    """Do the effects survive a re-run? Pairs of A and B (effects.csv) agree when
    |log r_A - log r_B| <= sqrt(h_A^2 + h_B^2) (h: log half-widths); and the summaries' verdicts
    (by = all) against each other."""
    fa, fb = (pd.read_csv(d / "effects.csv") for d in (a, b))
    if fa.empty or fb.empty:
        return {"effects_pairs": 0}
    m = fa.merge(fb, on=EFFECT_KEYS, suffixes=("_a", "_b"))
    hits, rel = 0, []
    for r in m.to_dict("records"):
        h = [math.log(r[f"ratio_ci_high_{s}"] / r[f"ratio_ci_low_{s}"]) / 2 for s in ("a", "b")]
        hits += abs(math.log(r["ratio_a"] / r["ratio_b"])) <= math.hypot(*h)
        rel += h
    sa, sb = (pd.read_csv(d / "effects_summary.csv") for d in (a, b))
    sm = sa[sa["by"] == "all"].merge(
        sb[sb["by"] == "all"], on=["factor", "baseline", "alternative"], suffixes=("_a", "_b")
    )
    return {
        "effects_pairs": len(m),
        "effects_coverage": f"{hits}/{len(m)}",
        "effects_coverage_pct": round(100 * hits / len(m), 1) if len(m) else None,
        "median_effect_rel_halfwidth_pct": round(100 * (math.exp(statistics.median(rel)) - 1), 2)
        if rel
        else None,
        "effect_summaries_same_verdict": (
            f"{int((sm['verdict_a'] == sm['verdict_b']).sum())}/{len(sm)}"
        ),
        "effect_summaries": {
            f"{r['factor']}: {r['alternative']} vs {r['baseline']}": (
                f"A {r['ratio_a']:.3f} [{r['ratio_ci_low_a']:.3f}, {r['ratio_ci_high_a']:.3f}] "
                f"{r['verdict_a']}; B {r['ratio_b']:.3f} [{r['ratio_ci_low_b']:.3f}, "
                f"{r['ratio_ci_high_b']:.3f}] {r['verdict_b']}"
            )
            for r in sm.to_dict("records")
        },
    }


def slowed_effects(c: Path) -> str:
    """In run C the fused way is 1.2x slower: its effects against the other structures should
    say so (fused vs separate: a ratio near 1/1.2 times what A found)."""
    fc = pd.read_csv(c / "effects.csv")
    fused = fc[(fc["factor"] == "structure") & (fc["alternative"] == SLOW_VARIANT)]
    slower = int((fused["verdict"] == "slower").sum())
    return f"{slower}/{len(fused)} pairs with {SLOW_VARIANT} as the alternative say slower"


def rankings(ra: pd.DataFrame, rb: pd.DataFrame) -> dict:
    m = ra.merge(rb, on="shape", suffixes=("_a", "_b"))
    agree = overlap = flips = mha_bad = 0
    for r in m.to_dict("records"):
        ca = set(str(r["contenders_a"]).split(";"))
        cb = set(str(r["contenders_b"]).split(";"))
        wa, wb = (str(r[k]) if r[k] == r[k] else "" for k in ("winner_a", "winner_b"))
        agree += wa == wb
        overlap += bool(ca & cb)
        flips += bool(wa and wb and wa != wb)
        slow = all(r[f"best_speedup_{s}"] >= 1.5 for s in ("a", "b"))
        mha_bad += slow and ("reference" in ca or "reference" in cb)
    return dict(
        shapes=len(m),
        winners_agree=agree,
        contenders_overlap=overlap,
        winner_flips=flips,
        mha_contender_where_clearly_slower=mha_bad,
    )


def compare(a: Path, b: Path, out: Path) -> tuple[int, pd.DataFrame]:
    proc = subprocess.run(
        [sys.executable, "-m", "harness.compare", str(a), str(b), "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    if proc.returncode not in (0, 1, 3):  # 3: not comparable (a busy run), said in its rows
        sys.exit(f"stability: compare failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc.returncode, pd.read_csv(out.with_suffix(".csv"))


def main() -> int:
    parser = argparse.ArgumentParser(description=headline(__doc__))
    parser.add_argument(
        "--out", default=None, help="work dir (default: results/stability/<date_time>)"
    )
    parser.add_argument(
        "--gap", type=float, default=60, help="seconds to wait between runs A and B (default 60)"
    )
    parser.add_argument(
        "--preset", default=None, help="a conf/sweep preset to run instead of the small sweep"
    )
    parser.add_argument(
        "--no-slowdown", action="store_true", help="skip run C (the 1.2x slowed way)"
    )
    parser.add_argument(
        "--store-floor",
        action="store_true",
        help="write the measured floor's upper bound into harness/floors.json (--floors) for the "
        "device kind: the between-run floor the harness's intervals use",
    )
    parser.add_argument(
        "--floors", default=str(floors.PATH), help="the floors file --store-floor writes"
    )
    parser.add_argument(
        "--fresh-floor",
        action="store_true",
        help="--store-floor from this re-run alone, forgetting the machine's earlier re-runs "
        f"(default: pooled with the last {floors.MAX_RUNS - 1} of the same machine)",
    )
    parser.add_argument(
        "--by", default="make stability", help="the command --store-floor records as the source"
    )
    parser.add_argument(
        "--reread",
        metavar="DIR",
        default=None,
        help="run nothing: re-read an earlier stability dir's runs A and B (their journals) with "
        "today's estimator, print its figures and, with --store-floor, pool it into the floor",
    )
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run")
    args = parser.parse_args()
    if args.reread:
        return reread_pair(Path(args.reread), args)
    out = Path(
        args.out or REPO / "results" / "stability" / datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    ).resolve()
    out.mkdir(parents=True, exist_ok=True)
    slow_dir = out / "slowdown"
    slow_dir.mkdir(exist_ok=True)
    (slow_dir / "sitecustomize.py").write_text(SLOWDOWN)

    sweep = [f"sweep={args.preset}"] if args.preset else sweep_for(args.overrides)
    a, wall_a = run_sweep(out, "A", sweep, args.overrides)
    time.sleep(args.gap)
    b, wall_b = run_sweep(out, "B", sweep, args.overrides)
    c, wall_c = (
        (None, None)
        if args.no_slowdown
        else run_sweep(out, "C", sweep, args.overrides, paths=(slow_dir,))
    )

    hits, n, rel = coverage(a, b, "speedup", "speedup_ci_low", "speedup_ci_high")
    lat_hits, lat_n, _ = coverage(
        a, b, "latency_ms_median", "latency_ms_ci_low", "latency_ms_ci_high"
    )
    floor = next(
        (float(o.split("=", 1)[1]) for o in args.overrides if o.startswith("timing.rerun_noise=")),
        None,
    )
    if floor is None:  # the rows' own (measured per shape on CUDA): the median over run A's
        floor = pd.to_numeric(a.get("rerun_noise"), errors="coerce").median()
        if not floor == floor:  # no such column: the device's default
            floor = config.rerun_floor(str(a["device"].iloc[0]))[0]
    rerun = rerun_floor(a, b, floor)
    estimate, upper, points = floors.pooled([rerun])
    stored = (
        store_floor(a, rerun, args.by, Path(args.floors), args.fresh_floor)
        if args.store_floor
        else None
    )
    rank = rankings(pd.read_csv(out / "A" / "ranking.csv"), pd.read_csv(out / "B" / "ranking.csv"))
    exit_ab, ab = compare(out / "A", out / "B", out / "compare-A-B.html")
    if c is not None:
        exit_ac, ac = compare(out / "A", out / "C", out / "compare-A-C.html")
        slowed = ac[ac["variant"] == SLOW_VARIANT]
        slowdown = {
            "compare_slowed_flagged": (
                f"{int((slowed['verdict'] == 'regression').sum())}/{len(slowed)}"
            ),
            "compare_slowed_exit": exit_ac,
            "compare_slowed_false_alarms_elsewhere": int(
                ((ac["variant"] != SLOW_VARIANT) & (ac["verdict"] == "regression")).sum()
            ),
            "effects_slowed": slowed_effects(out / "C"),
        }
    else:
        slowdown = {}
    figures = {
        "points": int(len(a)),
        "speedup_coverage": f"{hits}/{n}",
        "speedup_coverage_pct": round(100 * hits / n, 1) if n else None,
        "median_speedup_rel_halfwidth_pct": round(100 * pd.Series(rel).median(), 2)
        if rel
        else None,
        "latency_coverage": f"{lat_hits}/{lat_n}",
        "rerun_noise_used": floor,
        "rerun_noise_measured": round(estimate, 4),
        "rerun_noise_upper": round(upper, 4),
        "rerun_noise_points": points,
        "floor_stored": stored,
        **rank,
        **effects_agreement(out / "A", out / "B"),
        "compare_same_code_regressions": f"{int((ab['verdict'] == 'regression').sum())}/{len(ab)}",
        "compare_same_code_exit": exit_ab,
        **slowdown,
        "wall_s": [round(w, 1) for w in (wall_a, wall_b, wall_c) if w is not None],
        "timed_s": [round(float(df["timing_s"].sum()), 1) for df in (a, b, c) if df is not None],
        "overrides": args.overrides,
        "dir": str(out),
    }
    write_figures(figures, out / "stability.json")
    return 0


def reread_pair(out: Path, args) -> int:
    """``--reread``: an earlier pair's coverage and floor under today's estimator, pooled into
    the stored floor with ``--store-floor``."""
    if not all((out / side / "rounds.jsonl").is_file() for side in "AB"):
        print(
            f"stability: --reread {out}: no A/rounds.jsonl and B/rounds.jsonl there",
            file=sys.stderr,
        )
        return 2
    a, b = reread(out / "A"), reread(out / "B")
    floor = pd.to_numeric(a["rerun_noise"], errors="coerce").median()
    hits, n, rel = coverage(a, b, "speedup", "speedup_ci_low", "speedup_ci_high")
    # measured when its runs ran, not today
    when = datetime.fromtimestamp((out / "B" / "rounds.jsonl").stat().st_mtime).date()
    rerun = dataclasses.replace(rerun_floor(a, b, floor), measured=when.isoformat())
    estimate, upper, points = floors.pooled([rerun])
    figures = {
        "reread": str(out),
        "speedup_coverage": f"{hits}/{n}",
        "median_speedup_rel_halfwidth_pct": round(100 * pd.Series(rel).median(), 2)
        if rel
        else None,
        "rerun_noise_used": floor,
        "rerun_noise_measured": round(estimate, 4),
        "rerun_noise_upper": round(upper, 4),
        "rerun_noise_points": points,
        "floor_stored": store_floor(a, rerun, args.by, Path(args.floors), args.fresh_floor)
        if args.store_floor
        else None,
    }
    write_figures(figures, out / "reread.json")
    return 0


def write_figures(figures: dict, path: Path) -> None:
    """The figures as JSON at ``path``, and printed one per line."""
    path.write_text(json.dumps(figures, indent=2) + "\n")
    width = max(len(k) for k in figures)
    for k, v in figures.items():
        print(f"{k:<{width}}  {v}")


if __name__ == "__main__":
    sys.exit(main())
