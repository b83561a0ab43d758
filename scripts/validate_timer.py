"""Does the harness timer agree with other timers on the same call? (make validate-timer)

For a few points it times the harness's exact callable with the harness timer and with
torch.utils.benchmark (blocked_autorange, same thread count), and on CUDA with
triton.testing.do_bench when triton is installed, and prints the ratios; on a CPU they should
fall within 0.9 to 1.1. The timers take turns, five rounds of about a second each; the ratio
printed is the median of the five paired ratios (each from two adjacent measurements), so that
a shared machine's drift hits both timers alike. Medians of the rounds are printed too.
Then it repeats one point five times with the harness timer and prints the coefficient of
variation of the medians. Exits 1 when a ratio is outside the band.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
import torch.utils.benchmark as tub

from harness.point import timing_setup
from harness.sweep.run import point_for
from harness.measure.timing import Window, measure

POINTS = [  # (variant, options, seq_len, mode); B=2, E=256, H=4, float32
    ("fused", {"attention": "sdpa", "merge": "view"}, 128, "fwd"),
    ("fused", {"attention": "sdpa", "merge": "view"}, 1024, "fwd"),
    ("separate", {"attention": "manual", "merge": "reshape"}, 512, "fwd"),
    ("reference", {}, 512, "fwd"),
    ("packed", {"attention": "sdpa", "merge": "view"}, 512, "fwd_bwd"),
]
BAND = (0.9, 1.1)
ROUNDS = 5
MIN_TIME = 1.0  # s per measurement, for both timers


def point_at(name, options, seq_len, mode, device):
    return point_for(
        name,
        batch=2,
        seq_len=seq_len,
        embed_dim=256,
        num_heads=4,
        dtype="float32",
        device=device,
        mode=mode,
        variant=options,
    )


def harness_ms(point) -> float:
    call, before = timing_setup(point)
    window = Window(
        min_time=MIN_TIME, max_time=2 * MIN_TIME, max_noise=0.005, flush_l2=point.timing.flush_l2
    )
    return measure(call, point.device, window, before_sample=before).median_ms


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
    args = parser.parse_args()
    device = (
        "cuda"
        if args.device == "auto" and torch.cuda.is_available()
        else ("cpu" if args.device == "auto" else args.device)
    )
    print(f"device={device} threads={torch.get_num_threads()} torch={torch.__version__}")
    print(
        f"{'point':44s} {'harness ms':>11s} {'tub ms':>9s} {'ratio':>6s} "
        f"{'do_bench':>9s} {'ratio':>6s}"
    )
    outside = 0
    for name, options, seq_len, mode in POINTS:
        point = point_at(name, options, seq_len, mode, device)
        rounds = [(harness_ms(point), tub_ms(point)) for _ in range(ROUNDS)]
        h, t = (statistics.median(r[i] for r in rounds) for i in (0, 1))
        pair_ratios = sorted(a / b for a, b in rounds)
        d = do_bench_ms(point) if device.startswith("cuda") else None
        ratio = statistics.median(pair_ratios)  # paired: each ratio from two adjacent measurements
        outside += not (BAND[0] <= ratio <= BAND[1])
        name = f"{point.variant.name}/{'/'.join(options.values()) or '-'} L={seq_len} {mode}"
        extra = f"{d:9.4f} {h / d:6.3f}" if d else f"{'-':>9s} {'-':>6s}"
        print(
            f"{name:44s} {h:11.4f} {t:9.4f} {ratio:6.3f} {extra}  "
            f"(pair ratios {pair_ratios[0]:.3f}..{pair_ratios[-1]:.3f})"
        )

    point = point_at(*POINTS[1], device)
    medians = [harness_ms(point) for _ in range(5)]
    cv = statistics.stdev(medians) / statistics.mean(medians)
    print(
        f"repeatability, {point.variant.name} L={point.seq_len}, 5 runs: medians "
        f"{', '.join(f'{m:.4f}' for m in medians)} ms, coefficient of variation {100 * cv:.2f}%"
    )
    print(
        f"{'all' if not outside else outside} ratio{'s' if outside != 1 else ''} "
        f"{'within' if not outside else 'outside'} {BAND[0]}..{BAND[1]}"
    )
    return 1 if outside else 0


if __name__ == "__main__":
    sys.exit(main())
