"""What "timed equals checked" costs (docs/measurements.md), on this machine.

    python scripts/recheck_cost.py [--json FILE]

- The call counter every timed call goes through (``harness.way.recheck.Counted``): ns per call,
  against the bare call, in one run (ratios, not absolute times, are what a busy machine keeps).
- Per point: ``check_s`` (the oracle, nn.MHA, the variant's first call, a decode point's second
  step), ``fp32_check_s`` (the float32 structure check of a half-precision point, part of
  ``check_s``), ``act_check_s`` (the activation-scale check, part of ``check_s``) and the
  re-check after the rounds, which is one call: the point's latency.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness import time_it  # noqa: E402
from harness.way.recheck import Counted  # noqa: E402
from harness.progress import headline  # noqa: E402

POINTS = [
    ("prefill float32", dict(seq_len=512, mask="causal")),
    ("prefill bfloat16", dict(seq_len=512, mask="causal", dtype="bfloat16")),
    (
        "prefill bfloat16 fwd_bwd",
        dict(seq_len=256, mask="causal", dtype="bfloat16", mode="fwd_bwd"),
    ),
    ("decode P=2048 bfloat16", dict(seq_len=1, kv_cache_len=2048, dtype="bfloat16")),
    (
        "decode P=512 W=256 bfloat16",
        dict(seq_len=1, kv_cache_len=512, mask="sliding", window=256, dtype="bfloat16"),
    ),
]
TIMING = {"rounds": 5, "round_time": 0.05}


def counter_ns(calls: int = 200_000) -> tuple[float, float]:
    """ns per call of a no-op, bare and through Counted (the best of 5 runs each)."""

    def noop():
        return None

    counted = Counted(noop)
    best = {}
    for name, fn in (("bare", noop), ("counted", counted)):
        runs = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            runs.append((time.perf_counter() - t0) / calls * 1e9)
        best[name] = min(runs)
    return best["bare"], best["counted"]


def main() -> int:
    parser = argparse.ArgumentParser(description=headline(__doc__))
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    bare, counted = counter_ns()
    print(f"call counter: {counted - bare:.0f} ns per call ({bare:.0f} ns bare no-op call)")
    rows = []
    for name, keys in POINTS:
        row = time_it("fused", variant={"attention": "sdpa"}, timing=TIMING, **keys)
        figures = {
            "point": name,
            "status": row["status"],
            "check_s": row.get("check_s"),
            "fp32_check_s": row.get("fp32_check_s"),
            "act_check_s": row.get("act_check_s"),
            "recheck_ms": row.get("latency_ms_median"),  # one call
            "timed_s": row.get("timing_s"),
        }
        rows.append(figures)
        fp32, act = figures["fp32_check_s"], figures["act_check_s"]
        print(
            f"{name:<28} {row['status']:<8} check {figures['check_s']:.3f} s"
            + (f" (float32 check {fp32:.3f} s)" if fp32 else "")
            + (f" (activation scale {act:.3f} s)" if act else "")
            + f"; re-check one call {figures['recheck_ms']:.3g} ms"
            f" of {figures['timed_s']:.2f} s timing"
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"counter_ns": counted - bare, "points": rows}, indent=1)
        )
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
