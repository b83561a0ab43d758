"""The profiling pass (``profile=true``): after timing, never inside it.

torch.profiler runs the point's timed callable under a schedule (``profiler.wait``, ``warmup``,
``active``, ``repeat``), CPU activity always and CUDA activity on GPU, and writes the trace with
``tensorboard_trace_handler`` to ``<run or sweep dir>/traces/<point>/``: one TensorBoard run per
point (``tensorboard --logdir <dir>/traces``). The trace is Chrome-trace JSON, which Perfetto
opens as it is. Next to it, ``summary.csv``: operators by self time with their counts per call,
the evidence for questions like "does reshape copy where view does not".
"""

from __future__ import annotations

import csv
import io
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

from harness.config import ProfilerOptions
from harness.measure.probe import cupti_teardown, quiet_stderr

SUMMARY_FILE = "summary.csv"
SUMMARY_COLUMNS = [
    "op",
    "calls_per_call",
    "self_cpu_us_per_call",
    "cpu_total_us_per_call",
    "self_device_us_per_call",
]
# Ops that move data: aten::copy_ is where every real copy lands (contiguous(), a reshape that
# cannot view, .to()), so it is the count that answers view vs reshape.
COPY_OPS = ("aten::copy_",)


@dataclass(frozen=True)
class ProfileResult:
    trace_dir: Path
    ops_per_call: float  # aten ops per call (nested ones included)
    copies_per_call: float  # aten::copy_ per call
    kernels_per_call: float | None  # CUDA kernels per call; None on CPU
    top_ops: str  # the five ops with most self time, "aten::mm x6; aten::copy_ x2; ..."


def point_name(row: dict, job_num: int | None) -> str:
    """A readable, file-safe name for the point: 003_fused-sdpa-view_B2_L128_E256_H4_float32_..."""
    parts = [
        str(row["label"]).replace("/", "-"),
        f"B{row['batch']}_L{row['seq_len']}"
        + (f"_S{row['kv_seq_len']}" if row.get("cross") else "")
        + f"_E{row['embed_dim']}_H{row['num_heads']}",
        str(row["dtype"]),
        f"mask-{row['mask']}",
        str(row["mode"]),
    ]
    if row.get("compile") not in (None, "off"):
        parts.append(f"compile-{row['compile']}")
    if row.get("sdpa_backend") not in (None, "auto"):
        parts.append(f"sdpa-{row['sdpa_backend']}")
    name = "_".join(parts)
    if job_num is not None:
        name = f"{job_num:03d}_{name}"
    return re.sub(r"[^A-Za-z0-9_.=+-]", "-", name)


@dataclass
class _Op:
    """One operator's totals over every recorded cycle."""

    count: int = 0
    self_cpu_us: float = 0.0
    cpu_total_us: float = 0.0
    self_device_us: float = 0.0

    @property
    def self_us(self) -> float:
        return self.self_cpu_us + self.self_device_us


class _Cycles:
    """Adds up each cycle as the profiler hands it over. After the profile, ``key_averages()``
    holds only the last cycle, so with ``profiler.repeat`` above 1 the per-call counts came out
    divided by every cycle's calls (halved at repeat=2)."""

    def __init__(self, write: Callable, cuda: bool):
        self.write, self.cuda = write, cuda
        self.ops: dict[str, _Op] = {}
        self.kernels = 0
        self.cycles = 0

    def __call__(self, prof) -> None:
        self.write(prof)
        self.cycles += 1
        for e in prof.key_averages():
            if e.key.startswith("ProfilerStep"):
                continue
            op = self.ops.setdefault(e.key, _Op())
            op.count += e.count
            op.self_cpu_us += e.self_cpu_time_total
            op.cpu_total_us += e.cpu_time_total
            op.self_device_us += getattr(e, "self_device_time_total", 0)
        if self.cuda:
            self.kernels += sum(
                1
                for e in prof.events()
                if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA
            )


def run_profile(
    call: Callable[[], object],
    before: Callable[[], object] | None,
    device: str,
    trace_dir: Path,
    worker: str,
    opts: ProfilerOptions,
) -> ProfileResult:
    cuda = device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    cupti_teardown(device)  # no tracing left attached to the points timed after this one
    trace_dir.mkdir(parents=True, exist_ok=True)
    steps = (opts.wait + opts.warmup + opts.active) * opts.repeat
    cycles = _Cycles(tensorboard_trace_handler(str(trace_dir), worker_name=worker), cuda)
    with (
        quiet_stderr(),
        warnings.catch_warnings(),  # "Profiler clears events at the end of each cycle": _Cycles
        profile(
            activities=activities,
            schedule=schedule(
                wait=opts.wait, warmup=opts.warmup, active=opts.active, repeat=opts.repeat
            ),
            on_trace_ready=cycles,
            record_shapes=opts.record_shapes,
            profile_memory=opts.profile_memory,
            with_stack=opts.with_stack,
        ) as prof,
    ):
        warnings.filterwarnings("ignore", message=".*Profiler clears events")
        for _ in range(steps):
            if before:
                before()
            call()
            if cuda:
                torch.cuda.synchronize()
            prof.step()
    calls = opts.active * cycles.cycles
    ops = sorted(cycles.ops.items(), key=lambda kv: kv[1].self_us, reverse=True)
    write_summary(trace_dir / SUMMARY_FILE, ops, calls)
    aten = [(k, op) for k, op in ops if k.startswith("aten::")]
    return ProfileResult(
        trace_dir=trace_dir,
        ops_per_call=sum(op.count for _, op in aten) / calls,
        copies_per_call=sum(op.count for k, op in aten if k in COPY_OPS) / calls,
        kernels_per_call=cycles.kernels / calls if cuda else None,
        top_ops="; ".join(f"{k} x{op.count / calls:g}" for k, op in ops[:5]),
    )


def write_summary(path: Path, ops: list[tuple[str, _Op]], calls: int) -> None:
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(SUMMARY_COLUMNS)
    for key, op in ops:
        writer.writerow(
            [
                key,
                op.count / calls,
                op.self_cpu_us / calls,
                op.cpu_total_us / calls,
                op.self_device_us / calls,
            ]
        )
    path.write_text(buf.getvalue())
