"""The GPU probe (make gpu-check STEP=probe): what the graph-replay timing does on a real GPU, in
at most 4 minutes, before the longer steps rely on it (issue 56). Four measurements:

1. **pool**: at the main job's largest shapes (B=8, E=1024, 16 heads, bfloat16, causal,
   L=2048 and 4096; nn.MHA and fused), each point alone: what it holds once its call is
   captured (``Session.nbytes``: its tensors plus the graph's pool, measured across the
   capture) against what the memory budget set aside for it before the capture (its tensors
   and its warm call's measured peak: ``Session.graph_bytes``), beside the variant's footprint
   model (``rounds.expected_bytes``, the estimate before it is built). Held: the estimate is at
   least what was measured (the budget never under-counts a point, which would end in an
   ``oom`` row). **block**: the four waiting together, their graphs in one pool
   (``timing.GraphMemory``): held, at most what they held alone.
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
from harness.measure.rounds import Pool, expected_bytes  # noqa: E402
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


def _point(name: str, device: str, seq_len: int, resident_mb=None):
    return make_point(
        name, device=device, seq_len=seq_len, timing={**QUICK, "resident_mb": resident_mb}, **SHAPE
    )


def pool(device: str) -> list[dict]:
    """Each point alone, in a pool of its own: what it holds once captured against the estimate
    the budget used before the capture (its warm call's measured peak: ``Session.graph_bytes``),
    and the variant's footprint model (the estimate before it is built: ``expected_bytes``)."""
    out = []
    for seq_len in POOL_LENGTHS:
        for name in ("reference", "fused"):
            point = _point(name, device, seq_len)
            footprint = expected_bytes(point)
            record, session = prepare_point(point)
            row = dict(point=f"{name} L={seq_len}", status=record.status)
            if session is not None:
                estimate = session.nbytes + session.graph_bytes()
                Pool(say=lambda _: None).add(session)  # captured, in a pool of its own
                row.update(
                    estimate_mb=estimate / 2**20,
                    held_mb=session.nbytes / 2**20,
                    call_mb=session.call_bytes / 2**20,
                    footprint_mb=footprint / 2**20,
                    timed_by=session.timed_by,
                    graph_error=session.graph_error,
                )
            del record, session
            torch.cuda.empty_cache()
            out.append(row)
    return out


def block(device: str) -> dict:
    """The same points waiting together (one block: their graphs share one pool): what they hold
    together against the sum of what each held alone."""
    sessions, rows = [], []
    waiting = Pool(say=lambda _: None)
    base = torch.cuda.memory_reserved()
    for seq_len in POOL_LENGTHS:
        for name in ("reference", "fused"):
            # a budget that keeps the four in one block (the probe measures, it does not time)
            record, session = prepare_point(_point(name, device, seq_len, resident_mb=2**20))
            if session is not None:
                waiting.add(session)
                sessions.append(session)
            rows.append(record.status)
    held = sum(s.nbytes for s in sessions) / 2**20
    reserved = (torch.cuda.memory_reserved() - base) / 2**20
    del sessions
    waiting.sessions.clear()
    torch.cuda.empty_cache()
    return dict(statuses=rows, held_mb=held, reserved_mb=reserved)


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
    together = fig.get("block")
    alone = sum(r.get("held_mb") or 0 for r in fig.get("pool") or [])
    if together is not None and alone and together["held_mb"] > alone:
        misses.append(f"block: held {together['held_mb']:.0f} MB together > {alone:.0f} alone")
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
    steps = (("pool", pool), ("block", block), ("decode", decode), ("capture", capture))
    for name, measure in steps:
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
