"""Does the harness timer agree with other timers on the same call? (make validate-timer)

For a few points it times the harness's exact callable (``harness.point.timing_setup``) with the
harness timer and with other timers, and prints the ratios.

On CUDA each point gets the times the harness records, each held against a timer that takes
it the same way (issue 56: before, the flushed replay a row records was never compared, and the
eager time was taken with a flush that sweeps do not make):

- **device time** (``latency_ms_*``): the call captured once in a CUDA graph and replayed, the
  L2 flushed before each replay, each between its own CUDA events
  (``harness.measure.timing.measure`` with ``Window(cuda_graph=True)``). Held against a graph
  benchmark that clears the cache the same way (``graph_with_cache_clear_ms``: tritonbench's
  ``do_bench_cudagraph_with_cache_clear`` rule, one graph of n x (the point's ``before``, the
  harness's flush, the call) less one graph of the n flushes, with the harness's flush buffer) at
  **every** point: within 0.95-1.05.
- **warm replay** (``replay_warm_ms_median``, what ``launch_bound`` compares the eager time
  with): the same replay without the flush. Held against triton's ``do_bench_cudagraph`` (one
  graph of back-to-back calls, no flush) at every point: within 0.95-1.05.
- **eager time** (``eager_ms_*``), as sweeps take it: CUDA events around each eager call, back to
  back, no flush (what a Python caller calling it in a loop waits). Held against
  torch.utils.benchmark's ``blocked_autorange`` (blocks of back-to-back calls, synchronised at
  each block's ends: the same loop timed by the host) within 0.9-1.1 at every point. The events
  themselves are held against triton's ``do_bench`` (the same events, the same 256 MiB flush:
  the harness's eager call with its flush on) within 0.95-1.05 where the GPU sets the pace.
- **launch_bound** by ``harness.schema``'s rule: eager time >= ``LAUNCH_BOUND`` x the warm
  replay (Python enqueues the call more slowly than the GPU runs it). Such a point's do_bench
  ratio is not counted.

In mode=fwd_bwd every benchmark clears the gradients before each call as the harness does (its
``before``): without it triton's ``do_bench`` timed an accumulation into the last call's
gradients that no row contains.

On a CPU (where every call is waited for) torch.utils.benchmark (blocked_autorange, same thread
count) is held against the harness's time within 0.9-1.1. A call that cannot
be captured in a graph says why, and keeps its eager figures.

The CUDA points are GPU-sized (B=4, E=1024, 16 heads, bfloat16): at the CPU's shapes an H100
waits for Python. The timers take turns, five rounds (about 0.5-1 s per measurement on CUDA, 1 s
on a CPU); each ratio printed is the median of the five paired ratios (each from two adjacent
measurements), so that a shared machine's drift hits both timers alike. Then it repeats one
point five times with the harness timer (the device time on CUDA) and prints the coefficient of
variation of the medians. On an H100 it takes about 2.5 minutes (5 points x 5 rounds x ~6
measurements of ~1 s; ``make gpu-check STEP=timer``). Exits 1 when a counted ratio is outside
its band; ``--json`` writes the figures too.
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.utils.benchmark as tub

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's harness
from harness.factory import make_point  # noqa: E402
from harness.measure import timing  # noqa: E402
from harness.measure.timing import Window, measure  # noqa: E402
from harness.point import timing_setup  # noqa: E402
from harness.schema import LAUNCH_BOUND  # noqa: E402

POINTS = [  # (variant, options, seq_len, mode); CPU: B=2, E=256, H=4, float32
    ("fused", {"attention": "sdpa", "merge": "view"}, 128, "fwd"),
    ("fused", {"attention": "sdpa", "merge": "view"}, 1024, "fwd"),
    ("separate", {"attention": "manual", "merge": "reshape"}, 512, "fwd"),
    ("reference", {}, 512, "fwd"),
    ("packed", {"attention": "sdpa", "merge": "view"}, 512, "fwd_bwd"),
]
# On CUDA the CPU's shapes are launch-bound (an H100 runs them in less time than Python takes to
# enqueue them). Shapes where the GPU sets the pace for most: B=4, E=1024, 16 heads, bfloat16.
# The first is launch-bound on an H100 (docs/measurements.md): its device time is still held to
# do_bench_cudagraph's.
CUDA_POINTS = [
    ("fused", {"attention": "sdpa", "merge": "view"}, 1024, "fwd"),
    ("fused", {"attention": "sdpa", "merge": "view"}, 4096, "fwd"),
    ("separate", {"attention": "manual", "merge": "reshape"}, 2048, "fwd"),
    ("reference", {}, 2048, "fwd"),
    ("packed", {"attention": "sdpa", "merge": "view"}, 2048, "fwd_bwd"),
]
SIZES = {
    "cpu": dict(batch=2, embed_dim=256, num_heads=4, dtype="float32"),
    "cuda": dict(batch=4, embed_dim=1024, num_heads=16, dtype="bfloat16"),
}
BAND = (0.9, 1.1)  # harness (eager on CUDA) / torch.utils.benchmark: every point
DO_BENCH_BAND = (0.95, 1.05)  # harness eager, flushed / triton's do_bench (same events and flush)
CUDAGRAPH_BAND = (0.95, 1.05)  # device time / the cache-clearing graph benchmark: every point
WARM_GRAPH_BAND = (0.95, 1.05)  # warm replay / triton's do_bench_cudagraph: every point
ROUNDS = 5
MIN_TIME = {"cpu": 1.0, "cuda": 0.5}  # s per measurement (a GPU's medians are steady sooner)
BENCH_REP_MS = 100  # triton's own repetition time per measurement


def point_at(name, options, seq_len, mode, device):
    return make_point(
        name,
        seq_len=seq_len,
        device=device,
        mode=mode,
        variant=options,
        **SIZES["cuda" if device.startswith("cuda") else "cpu"],
    )


def _min_time(point) -> float:
    return MIN_TIME["cuda" if point.device.startswith("cuda") else "cpu"]


def harness_timing(point, graph: bool = False, flush: bool | None = None):
    """The harness's one-window timer on the point's call: eager (events around each call), or
    with ``graph`` the call captured once in a CUDA graph and its replay timed (device time).
    ``flush``: the L2 flush before each call (None: the point's)."""
    call, before = timing_setup(point)
    window = Window(
        min_time=_min_time(point),
        max_time=2 * _min_time(point),
        max_noise=0.005,
        flush_l2=point.timing.flush_l2 if flush is None else flush,
        cuda_graph=graph,
    )
    return measure(call, point.device, window, before_sample=before)


def harness_ms(point, graph: bool = False, flush: bool | None = None) -> float:
    return harness_timing(point, graph, flush).median_ms


def capture_refused(point) -> str | None:
    """Why the harness cannot capture this point's call here (None: it can try). fwd_bwd clears
    its gradients before every call: a graph captured without that clearing would write them
    into memory the clearing frees, so it needs a ``cuda_graph`` that runs ``before`` first."""
    if not point.device.startswith("cuda"):
        return "device time is CUDA's (a CUDA graph)"
    if point.mode == "fwd_bwd" and "before" not in inspect.signature(timing.cuda_graph).parameters:
        return "this harness captures mode=fwd only (its cuda_graph takes no `before`)"
    return None


def device_ms(point, flush: bool | None = None) -> tuple[float | None, str | None]:
    """The device time (graph replay) in ms, or None and why the call could not be captured."""
    refused = capture_refused(point)
    if refused:
        return None, refused
    try:
        return harness_ms(point, graph=True, flush=flush), None
    except Exception as e:  # a call that cannot be captured keeps its eager figures
        return None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]


def tub_ms(point) -> float:
    """torch.utils.benchmark's blocked_autorange: blocks of back-to-back calls, timed by the host
    (on CUDA its timer synchronises at each block's ends, not after each call)."""
    call, before = timing_setup(point)

    def stmt():
        if before:
            before()  # torch.utils.benchmark has no untimed setup per call: fwd_bwd pays for it
        call()

    timer = tub.Timer(stmt="stmt()", globals={"stmt": stmt}, num_threads=torch.get_num_threads())
    return timer.blocked_autorange(min_run_time=_min_time(point)).median * 1e3


def do_bench_ms(point) -> float | None:
    """triton's ``do_bench``: CUDA events around each call, its 256 MiB flush before each. The
    point's ``before`` (fwd_bwd: clearing the gradients, as the harness does; host work, no
    kernel) runs inside each call: do_bench's ``grad_to_none`` needs the tensors, which the
    timed call keeps to itself."""
    try:
        from triton.testing import do_bench
    except ImportError:
        return None
    call, before = timing_setup(point)

    def fn():
        if before:
            before()
        return call()

    return do_bench(fn, warmup=50, rep=3 * BENCH_REP_MS, return_mode="median")


def graph_with_cache_clear_ms(point, retries: int = 10) -> float | None:
    """The device time as a graph benchmark that clears the cache as the harness does
    (tritonbench's ``do_bench_cudagraph_with_cache_clear`` rule): one graph of n x (the point's
    ``before``, zeroing the harness's flush buffer, the call), less one graph of the n zeroings,
    per call; the median over ``retries``. None off CUDA; raises when the call cannot be
    captured."""
    if not point.device.startswith("cuda"):
        return None
    call, before = timing_setup(point)
    flush = timing.flush_buffer(point.device)

    def once():
        if before:
            before()
        flush.zero_()
        call()

    def graph(body, n):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(n):
                body()
        torch.cuda.synchronize()
        return g

    def elapsed(g) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # warm up on the capture stream
            once()
        estimate = elapsed(graph(once, 5)) / 5
        n = max(1, int(BENCH_REP_MS / estimate)) if estimate > 0 else 1000
        full, flushes = graph(once, n), graph(flush.zero_, n)
        times = [(elapsed(full) - elapsed(flushes)) / n for _ in range(retries)]
    torch.cuda.current_stream().wait_stream(stream)
    return statistics.median(times)


def do_bench_cudagraph_ms(point) -> float | None:
    """triton's ``do_bench_cudagraph``: one graph of back-to-back calls (as many as fill its
    ``rep`` ms), replayed 10 times between two events; the median per call. fwd_bwd's clearing
    of gradients runs inside each captured call (Python only: no kernel), as the harness runs it
    before each replay. None without triton; raises when the call cannot be captured."""
    try:
        from triton.testing import do_bench_cudagraph
    except ImportError:
        return None
    call, before = timing_setup(point)

    def fn():
        if before:
            before()
        return call()

    try:
        return do_bench_cudagraph(fn, rep=BENCH_REP_MS, return_mode="median")
    except TypeError:  # an older triton without return_mode (it returned the median)
        return do_bench_cudagraph(fn, rep=BENCH_REP_MS)


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _ratio(pairs) -> float | None:
    """The median of paired ratios a / b (each pair measured one after the other)."""
    return _median([a / b for a, b in pairs if a is not None and b])


def _in(band, value) -> bool:
    return value is not None and band[0] <= value <= band[1]


def _cell(value, fmt: str, width: int) -> str:
    return f"{value:{width}{fmt}}" if value is not None else f"{'-':>{width}s}"


def time_point(point, cuda: bool) -> dict:
    """One point's figures: the timers in turns, ROUNDS rounds. On CUDA the eager time is taken
    as sweeps take it (no flush) and once more with the flush for do_bench; the device time
    flushed (as rows record it) and warm (as launch_bound compares it)."""
    capture_error = None
    rounds = []
    for _ in range(ROUNDS):
        r = dict(eager=harness_ms(point, flush=False if cuda else None), tub=tub_ms(point))
        if cuda:
            r["eager_flushed"] = harness_ms(point, flush=True)
            if capture_error is None:
                r["device"], capture_error = device_ms(point, flush=True)
            if capture_error is None:
                r["device_warm"], capture_error = device_ms(point, flush=False)
            r["do_bench"] = do_bench_ms(point)
            if capture_error is None:
                for key, bench in (
                    ("clear_graph", graph_with_cache_clear_ms),
                    ("cudagraph", do_bench_cudagraph_ms),
                ):
                    try:
                        r[key] = bench(point)
                    except Exception as e:
                        r.setdefault("cudagraph_error", f"{key}: {type(e).__name__}: {e}")
        rounds.append(r)

    def med(key):
        return _median([r.get(key) for r in rounds])

    def ratio(a, b):
        return _ratio([(r.get(a), r.get(b)) for r in rounds])

    eager, warm = med("eager"), med("device_warm")
    eager_device = eager / warm if eager and warm else None
    launch_bound = None if eager_device is None else eager_device >= LAUNCH_BOUND
    errors = [
        r["cudagraph_error"].splitlines()[0][:200] for r in rounds if r.get("cudagraph_error")
    ]
    return dict(
        eager_ms=eager,
        eager_flushed_ms=med("eager_flushed"),
        device_ms=med("device"),
        device_warm_ms=warm,
        flush_ratio=ratio("device", "device_warm"),
        eager_device_ratio=eager_device,
        launch_bound=launch_bound,
        capture_error=capture_error,
        tub_ms=med("tub"),
        tub_ratio=ratio("eager", "tub"),
        do_bench_ms=med("do_bench"),
        do_bench_ratio=ratio("eager_flushed", "do_bench"),
        clear_graph_ms=med("clear_graph"),
        clear_graph_ratio=ratio("device", "clear_graph"),
        cudagraph_ms=med("cudagraph"),
        cudagraph_ratio=ratio("device_warm", "cudagraph"),
        cudagraph_error=errors[0] if errors else None,
        pair_ratios=sorted(
            r["eager"] / r["tub"] for r in rounds if r.get("eager") and r.get("tub")
        ),
    )


def misses(row: dict, cuda: bool) -> bool:
    """Whether a point's counted ratio is outside its band: on CUDA its device time against the
    cache-clearing graph benchmark and its warm replay against do_bench_cudagraph (every point),
    its eager time against torch.utils.benchmark (every point) and, where the GPU sets the pace,
    its flushed eager time against do_bench; on a CPU against torch.utils.benchmark."""
    if not cuda:
        return not _in(BAND, row["tub_ratio"])
    held = [
        (CUDAGRAPH_BAND, row["clear_graph_ratio"]),
        (WARM_GRAPH_BAND, row["cudagraph_ratio"]),
        (BAND, row["tub_ratio"]),
    ]
    if row["launch_bound"] is not True:
        held.append((DO_BENCH_BAND, row["do_bench_ratio"]))
    return any(value is not None and not _in(band, value) for band, value in held)


def cuda_line(label: str, row: dict, miss: bool) -> str:
    cells = [
        _cell(row["eager_ms"], ".4f", 9),
        _cell(row["device_ms"], ".4f", 9),
        _cell(row["eager_device_ratio"], ".2f", 7),
        _cell(row["clear_graph_ratio"], ".3f", 9),
        _cell(row["cudagraph_ratio"], ".3f", 9),
        _cell(row["do_bench_ratio"], ".3f", 9),
        _cell(row["tub_ratio"], ".3f", 6),
        _cell(row["flush_ratio"], ".3f", 6),
    ]
    notes = [
        f"launch-bound (eager >= {LAUNCH_BOUND}x warm replay): do_bench ratio not counted"
        if row["launch_bound"]
        else "",
        f"not captured: {row['capture_error']}" if row["capture_error"] else "",
        f"graph benchmark: {row['cudagraph_error']}" if row["cudagraph_error"] else "",
        "OUTSIDE" if miss else "",
    ]
    return f"{label:40s} " + " ".join(cells) + "".join(f"  {n}" for n in notes if n)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda")
    parser.add_argument("--json", help="also write the figures to this file (make gpu-check)")
    args = parser.parse_args()
    device = (
        "cuda"
        if args.device == "auto" and torch.cuda.is_available()
        else ("cpu" if args.device == "auto" else args.device)
    )
    cuda = device.startswith("cuda")
    print(f"device={device} threads={torch.get_num_threads()} torch={torch.__version__}")
    if cuda:
        print(
            f"{'point':40s} {'eager ms':>9s} {'device ms':>9s} {'eag/warm':>7s} "
            f"{'/clr-grph':>9s} {'warm/cg':>9s} {'/do_bench':>9s} {'/tub':>6s} {'flush':>6s}"
        )
    else:
        print(f"{'point':40s} {'harness ms':>11s} {'tub ms':>9s} {'ratio':>6s}")
    outside, rows = 0, []
    for name, options, seq_len, mode in CUDA_POINTS if cuda else POINTS:
        point = point_at(name, options, seq_len, mode, device)
        label = f"{point.variant.name}/{'/'.join(options.values()) or '-'} L={seq_len} {mode}"
        row = dict(point=label, **time_point(point, cuda))
        miss = misses(row, cuda)
        outside += miss
        pr = row.pop("pair_ratios")
        if cuda:
            print(cuda_line(label, row, miss))
        else:
            print(
                f"{label:40s} {row['eager_ms']:11.4f} {row['tub_ms']:9.4f} {row['tub_ratio']:6.3f}"
                f"  (pair ratios {pr[0]:.3f}..{pr[-1]:.3f})" + ("  OUTSIDE" if miss else "")
            )
        rows.append(row)
        dump(args.json, device, rows, outside)

    point = point_at(*(CUDA_POINTS if cuda else POINTS)[1], device)
    graph = cuda and capture_refused(point) is None
    medians = [harness_ms(point, graph=graph) for _ in range(5)]
    cv = statistics.stdev(medians) / statistics.mean(medians)
    repeat_of = "device time (graph replay)" if graph else "eager time"
    print(
        f"repeatability, {point.variant.name} L={point.seq_len}, {repeat_of}, 5 runs: medians "
        f"{', '.join(f'{m:.4f}' for m in medians)} ms, coefficient of variation {100 * cv:.2f}%"
    )
    bands = (
        f"device/cache-clearing graph {CUDAGRAPH_BAND[0]}..{CUDAGRAPH_BAND[1]}, warm replay/"
        f"do_bench_cudagraph {WARM_GRAPH_BAND[0]}..{WARM_GRAPH_BAND[1]} and eager/"
        f"torch.utils.benchmark {BAND[0]}..{BAND[1]} at every point, flushed eager/do_bench "
        f"{DO_BENCH_BAND[0]}..{DO_BENCH_BAND[1]} where not launch-bound"
        if cuda
        else f"harness/torch.utils.benchmark {BAND[0]}..{BAND[1]}"
    )
    print(f"{outside or 'no'} point{'s' if outside != 1 else ''} outside their band ({bands})")
    dump(args.json, device, rows, outside, cv, repeat_of)
    return 1 if outside else 0


def dump(path, device, rows, outside, cv=None, repeat_of=None) -> None:
    """The figures so far (``--json``): written after every point, so that a run stopped by a
    deadline (make gpu-check) leaves the points it finished."""
    if not path:
        return
    figures = dict(
        device=device,
        points=rows,
        repeat_cv=cv,
        repeat_of=repeat_of,
        launch_bound_ratio=LAUNCH_BOUND,
        outside=outside,
        complete=cv is not None,  # the last figure: every point timed before it
    )
    with open(path, "w") as f:
        json.dump(figures, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
