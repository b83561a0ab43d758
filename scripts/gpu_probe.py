"""The GPU probe (make gpu-check STEP=probe): what the graph-replay timing does on a real GPU, in
at most 4 minutes, before the longer steps rely on it (issue 56). Three measurements:

1. **pool**: at the main job's largest shapes (B=8, E=1024, 16 heads, bfloat16, causal,
   L=2048 and 4096; nn.MHA and fused), what a point waiting for its rounds holds once its call
   is captured (``Session.nbytes``: its tensors plus the graph's private pool, measured across
   the capture) against what the memory budget set aside for it before it was built
   (``rounds.expected_bytes``). Held: the estimate is at least what was measured (the budget
   never under-counts a point, which would end in an ``oom`` row).
2. **capture**: in one process, a call that reads a tensor on the host inside (as a library's
   ``torch.all(mask)`` check does: a synchronize during the capture), then a good point: the
   first keeps its event timing and names its own error (not "a previous error during
   capture"), the second replays a graph; both ``ok``, the process alive.
3. **decode**: an L2-resident decode step (B=1, one new token on a 1024-token KV cache): its
   eager time against the flushed replay (the device time) and against the warm one, and
   ``launch_bound`` by the rule (against the warm one).

Writes its figures with ``--json`` after each measurement (a probe stopped by its deadline keeps
what it finished); exits 1 when a held figure misses, 2 without CUDA.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's harness
from harness.factory import make_point  # noqa: E402
from harness.measure.rounds import expected_bytes  # noqa: E402
from harness.point import prepare_point, run_point  # noqa: E402
from harness.progress import headline  # noqa: E402
from variants.fused import FusedQKVMHA  # noqa: E402

SHAPE = dict(batch=8, embed_dim=1024, num_heads=16, dtype="bfloat16", mask="causal")
POOL_LENGTHS = (2048, 4096)
QUICK = dict(rounds=3, round_time=0.05, warmup=0.2)  # the probe times little (s per round)
SECONDARY = "previous error during capture"


class ReadsOnTheHost(FusedQKVMHA):
    """The fused structure with a host read inside its call, as a library's mask check does
    (``if torch.all(mask)``): right, but not capturable in a CUDA graph."""

    title = "fused, reading a tensor on the host"

    def forward(self, query, key, value, **kwargs):
        if not bool(torch.isfinite(query[:1, :1]).all()):  # a synchronize inside the call
            raise ValueError("non-finite query")
        return super().forward(query, key, value, **kwargs)


def pool(device: str) -> list[dict]:
    """What each point holds once captured against the estimate made before it was built."""
    out = []
    for seq_len in POOL_LENGTHS:
        for name in ("reference", "fused"):
            point = make_point(name, device=device, seq_len=seq_len, timing=QUICK, **SHAPE)
            estimate = expected_bytes(point)
            record, session = prepare_point(point)
            row = dict(
                point=f"{name} L={seq_len}",
                status=record.status,
                estimate_mb=estimate / 2**20,
                held_mb=None if session is None else session.nbytes / 2**20,
                timed_by=None if session is None else session.timed_by,
                graph_error=None if session is None else session.graph_error,
            )
            del record, session
            torch.cuda.empty_cache()
            out.append(row)
    return out


def capture(device: str) -> list[dict]:
    """A call that cannot be captured, then a good one, in this one process."""
    rows = []
    for variant in (ReadsOnTheHost, "fused"):
        point = make_point(variant, device=device, seq_len=512, timing=QUICK, **SHAPE)
        row = run_point(point)
        rows.append(
            {k: row.get(k) for k in ("label", "status", "error", "timed_by", "graph_error")}
        )
    return rows


def decode(device: str) -> dict:
    """An L2-resident decode step: eager time against the flushed and the warm replay."""
    point = make_point(
        "fused",
        device=device,
        batch=1,
        seq_len=1,
        kv_cache_len=1024,
        embed_dim=1024,
        num_heads=16,
        dtype="bfloat16",
        timing=QUICK,
    )
    row = run_point(point)
    keys = ("status", "timed_by", "eager_ms_median", "latency_ms_median", "replay_warm_ms_median")
    return {**{k: row.get(k) for k in keys}, "launch_bound": row.get("launch_bound")}


def held(fig: dict) -> list[str]:
    """What misses: a pool estimate under what was measured, a capture that did not end as
    described, a decode point with no launch_bound."""
    misses = [
        f"pool {r['point']}: held {r['held_mb']:.0f} MB > estimate {r['estimate_mb']:.0f} MB"
        for r in fig.get("pool") or []
        if r.get("held_mb") is not None and r["held_mb"] > r["estimate_mb"]
    ]
    misses += [
        f"pool {r['point']}: {r['status']}" for r in fig.get("pool") or [] if r["status"] != "ok"
    ]
    first, second = [*(fig.get("capture") or []), None, None][:2]
    if first is not None:
        said = first.get("graph_error") or ""
        if first["status"] != "ok" or first["timed_by"] != "events" or SECONDARY in said:
            misses.append(f"capture: the failed capture's point read {first}")
    if second is not None and (second["status"] != "ok" or second["timed_by"] != "graph"):
        misses.append(f"capture: the good point after it read {second}")
    dec = fig.get("decode")
    if dec is not None and (dec["status"] != "ok" or dec.get("launch_bound") is None):
        misses.append(f"decode: {dec}")
    return misses


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=headline(__doc__))
    parser.add_argument("--json", help="write the figures to this file, after each measurement")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_probe: needs CUDA (torch sees no GPU)", file=sys.stderr)
        return 2
    device, fig = "cuda", {"device": torch.cuda.get_device_name()}
    # The capture last: a capture left open can abort the process at the next synchronize, and
    # what was measured before it is already written.
    for name, measure in (("pool", pool), ("decode", decode), ("capture", capture)):
        fig[name] = measure(device)
        print(f"{name}: {json.dumps(fig[name], default=str)}", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(fig, indent=1, default=str))
    misses = held(fig)
    fig["misses"], fig["complete"] = misses, True
    if args.json:
        Path(args.json).write_text(json.dumps(fig, indent=1, default=str))
    print("\n".join(misses) or "probe: every held figure met")
    return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main())
