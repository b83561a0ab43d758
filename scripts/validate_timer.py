"""Does the harness timer agree with other timers on the same call? (make validate-timer)

For a few points it times the harness's exact callable with the harness timer and with
torch.utils.benchmark (blocked_autorange, same thread count), and on CUDA with
triton.testing.do_bench when triton is installed, and prints the ratios: within 0.9 to 1.1
against torch.utils.benchmark, and on CUDA within 0.95 to 1.05 against do_bench (the same
events and the same 256 MiB flush). The CUDA points are GPU-sized: at the CPU's shapes an H100
waits for Python, and a device timer then reads the host's pace. The timers take turns, five
rounds of about a second each; the ratio printed is the median of the five paired ratios (each
from two adjacent measurements), so that a shared machine's drift hits both timers alike.
Medians of the rounds are printed too, and on CUDA the share of a call's latency that Python
takes to enqueue it (a launch-bound point is shown but not counted). Then it repeats one point
five times with the harness timer and prints the coefficient of variation of the medians.
Exits 1 when a counted ratio is outside its band; ``--json`` writes the figures too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
import torch.utils.benchmark as tub

from harness.point import timing_setup
from harness.factory import make_point
from harness.measure.timing import Window, measure
from harness.schema import LAUNCH_BOUND

POINTS = [  # (variant, options, seq_len, mode); CPU: B=2, E=256, H=4, float32
    ("fused", {"attention": "sdpa", "merge": "view"}, 128, "fwd"),
    ("fused", {"attention": "sdpa", "merge": "view"}, 1024, "fwd"),
    ("separate", {"attention": "manual", "merge": "reshape"}, 512, "fwd"),
    ("reference", {}, 512, "fwd"),
    ("packed", {"attention": "sdpa", "merge": "view"}, 512, "fwd_bwd"),
]
# On CUDA the CPU's shapes are launch-bound (an H100 runs them in less time than Python takes to
# enqueue them), and there a device timer measures the host's pace: whichever timer's flush
# hides more of the launches reads lower. Shapes where the GPU sets the pace: B=4, E=1024, 16
# heads, bfloat16. A point that is launch-bound all the same is shown, not counted.
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
BAND = (0.9, 1.1)  # harness / torch.utils.benchmark, CPU and CUDA
DO_BENCH_BAND = (0.95, 1.05)  # harness / triton's do_bench (same events, same flush size)
ROUNDS = 5
MIN_TIME = 1.0  # s per measurement, for both timers


def point_at(name, options, seq_len, mode, device):
    return make_point(
        name,
        seq_len=seq_len,
        device=device,
        mode=mode,
        variant=options,
        **SIZES["cuda" if device.startswith("cuda") else "cpu"],
    )


def harness_timing(point):
    call, before = timing_setup(point)
    window = Window(
        min_time=MIN_TIME, max_time=2 * MIN_TIME, max_noise=0.005, flush_l2=point.timing.flush_l2
    )
    return measure(call, point.device, window, before_sample=before)


def harness_ms(point) -> float:
    return harness_timing(point).median_ms


def tub_ms(point) -> float:
    call, before = timing_setup(point)
    cuda = point.device.startswith("cuda")

    def stmt():
        if before:
            before()  # torch.utils.benchmark has no untimed setup per call: fwd_bwd pays for it
        call()
        if cuda:
            torch.cuda.synchronize()

    timer = tub.Timer(stmt="stmt()", globals={"stmt": stmt}, num_threads=torch.get_num_threads())
    return timer.blocked_autorange(min_run_time=MIN_TIME).median * 1e3


def do_bench_ms(point) -> float | None:
    try:
        from triton.testing import do_bench
    except ImportError:
        return None
    call, before = timing_setup(point)
    return do_bench(call, warmup=50, rep=300, return_mode="median")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
    print(
        f"{'point':44s} {'harness ms':>11s} {'tub ms':>9s} {'ratio':>6s} "
        f"{'do_bench':>9s} {'ratio':>6s} {'launch':>6s}"
    )
    outside, rows = 0, []
    for name, options, seq_len, mode in CUDA_POINTS if cuda else POINTS:
        point = point_at(name, options, seq_len, mode, device)
        launch = harness_timing(point).launch_ms  # host time to enqueue a call (CUDA)
        rounds = [(harness_ms(point), tub_ms(point)) for _ in range(ROUNDS)]
        h, t = (statistics.median(r[i] for r in rounds) for i in (0, 1))
        pair_ratios = sorted(a / b for a, b in rounds)
        d = do_bench_ms(point) if cuda else None
        ratio = statistics.median(pair_ratios)  # paired: each ratio from two adjacent measurements
        bound = launch is not None and launch >= LAUNCH_BOUND * h
        counted = not bound
        miss = not (BAND[0] <= ratio <= BAND[1]) or (
            d is not None and not (DO_BENCH_BAND[0] <= h / d <= DO_BENCH_BAND[1])
        )
        outside += counted and miss
        label = f"{point.variant.name}/{'/'.join(options.values()) or '-'} L={seq_len} {mode}"
        extra = f"{d:9.4f} {h / d:6.3f}" if d else f"{'-':>9s} {'-':>6s}"
        share = f"{launch / h:6.2f}" if launch else f"{'-':>6s}"
        print(
            f"{label:44s} {h:11.4f} {t:9.4f} {ratio:6.3f} {extra} {share}  "
            f"(pair ratios {pair_ratios[0]:.3f}..{pair_ratios[-1]:.3f})"
            + ("  launch-bound: not counted" if bound else "")
        )
        rows.append(
            dict(
                point=label,
                harness_ms=h,
                tub_ms=t,
                tub_ratio=ratio,
                do_bench_ms=d,
                do_bench_ratio=h / d if d else None,
                launch_share=launch / h if launch else None,
                launch_bound=bound,
            )
        )

    point = point_at(*(CUDA_POINTS if cuda else POINTS)[1], device)
    medians = [harness_ms(point) for _ in range(5)]
    cv = statistics.stdev(medians) / statistics.mean(medians)
    print(
        f"repeatability, {point.variant.name} L={point.seq_len}, 5 runs: medians "
        f"{', '.join(f'{m:.4f}' for m in medians)} ms, coefficient of variation {100 * cv:.2f}%"
    )
    print(
        f"{'all' if not outside else outside} ratio{'s' if outside != 1 else ''} "
        f"{'within' if not outside else 'outside'} {BAND[0]}..{BAND[1]}"
        + (f" (do_bench {DO_BENCH_BAND[0]}..{DO_BENCH_BAND[1]})" if cuda else "")
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=device, points=rows, repeat_cv=cv, outside=outside), f, indent=1)
    return 1 if outside else 0


if __name__ == "__main__":
    sys.exit(main())
