"""torch.profiler's two runs of a point's timed call, both after its timing, never inside it:
the probe, what ran and what it held (``probe``), and the profiling pass, its trace
(``run_profile``).

The probe: one extra call, what ran and how much memory it took. Profiler overhead never enters
the timing.

- ``sdpa_kernel``: which F.scaled_dot_product_attention backend the call used, read from the
  aten op that ran (flash, efficient, cudnn, math, cpu_flash), or on CUDA, where no op was
  dispatched (a CUDA-graph replay), from the names of the kernels that ran; ``none`` when no
  SDPA op ran (manual attention); several joined by ``+``.
- ``peak_mem_mb``: on CUDA, max_memory_allocated during the call minus what was allocated
  before it (the caching allocator's own count). On CPU there is no such counter, so the
  profiler's memory events (every tensor allocation and free, in order) are summed and their
  running maximum taken: the peak of tensor memory the call allocated on top of what it was
  given. Not process RSS, which malloc's caching blurs.
- ``scores_materialized``: whether the full B x H x L x S score matrix existed in memory:
  a softmax op ran on a tensor of B*H*L*S elements (manual attention, SDPA's math backend,
  nn.MHA's weights path), or, for kernels that fuse the softmax away (torch.compile), an
  allocation of exactly that many bytes was made. The allocation rule is skipped when L or S
  equals D, 2D or 3D, where a (B, L|S, E|2E|3E) projection has the same size.

The profiling pass (``profile=true``): torch.profiler runs the point's timed callable under a
schedule (``profiler.wait``, ``warmup``, ``active``, ``repeat``), CPU activity always and CUDA
activity on GPU, and writes the trace with ``tensorboard_trace_handler`` to ``<run or sweep
dir>/traces/<point>/``: one TensorBoard run per point (``tensorboard --logdir <dir>/traces``).
The trace is Chrome-trace JSON, which Perfetto opens as it is. Next to it, ``summary.csv``:
operators by self time with their counts per call, the evidence for questions like "does reshape
copy where view does not".
"""

from __future__ import annotations

import csv
import io
import math
import os
import re
import sys
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

from harness.config import Point, ProfilerOptions
from harness.errors import one_line
from harness.schema import Identity, Probe, Profile

SDPA_OPS = {
    "aten::_scaled_dot_product_flash_attention": "flash",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "cpu_flash",
    "aten::_scaled_dot_product_efficient_attention": "efficient",
    "aten::_scaled_dot_product_cudnn_attention": "cudnn",
    "aten::_scaled_dot_product_attention_math": "math",
    "aten::_scaled_dot_product_fused_attention_overrideable": "overrideable",
}


# CUDA kernel names -> SDPA backend: what a CUDA-graph replay shows (it dispatches no aten op).
KERNEL_NAMES = [
    ("cudnn", "cudnn"),  # first: cuDNN's fused kernels are named ..._sdpa_..._flash_fprop_...
    ("flash_fwd", "flash"),
    ("flash_bwd", "flash"),
    ("fmha_cutlass", "efficient"),
    ("efficient_attention", "efficient"),
]


def backends_from_kernels(names) -> set[str]:
    """The SDPA backends whose CUDA kernels are among ``names`` (cuDNN's own SDPA kernels only:
    a name with both "cudnn" and "sdpa" or "fprop"/"bprop" of its fused attention)."""
    found = set()
    for name in names:
        low = name.lower()
        for part, backend in KERNEL_NAMES:
            if part in low and (backend != "cudnn" or "sdpa" in low or "flash" in low):
                found.add(backend)
                break
    return found


@dataclass(frozen=True)
class ProbeResult:
    sdpa_kernel: str
    peak_mem_mb: float
    scores_materialized: bool


@contextmanager
def quiet_stderr():
    """Kineto prints profiler start/stop lines straight to fd 2; keep the sweep's output clean."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def cupti_teardown(device: str) -> bool:
    """Ask Kineto to tear CUPTI down when a CUDA profile ends, so that no tracing is left
    attached to the calls timed after it: Kineto finalises CUPTI only with TEARDOWN_CUPTI=1, and
    left attached it slowed later work by 10-20% (PyTorch issue 144455). Not below CUDA 12.6,
    where a teardown crashes later CUDA-graph captures (torch itself sets 0 there), nor over a
    value the user set. Whether it was asked."""
    if not device.startswith("cuda") or "TEARDOWN_CUPTI" in os.environ:
        return False
    from torch.torch_version import TorchVersion

    version = getattr(torch.version, "cuda", None)
    if version is None or TorchVersion(version) < "12.6":
        return False
    os.environ["TEARDOWN_CUPTI"] = "1"
    return True


def probe(
    fn: Callable[[], object],
    device: str,
    dims: tuple[int, int, int, int, int],
    itemsize: int,
    before: Callable[[], object] | None = None,
) -> ProbeResult:
    """``dims`` is (B, H, L, S, D); ``itemsize`` the bytes of one element of the point's dtype."""
    B, H, L, S, D = dims
    n_scores = B * H * L * S
    cuda = device.startswith("cuda")
    if before:
        before()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    cupti_teardown(device)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    with (
        quiet_stderr(),
        profile(activities=activities, profile_memory=True, record_shapes=True) as prof,
    ):
        fn()
        if cuda:
            torch.cuda.synchronize()
    events = prof.profiler.kineto_results.events()
    kernels = {SDPA_OPS[e.name()] for e in events if e.name() in SDPA_OPS}
    if cuda and not kernels:  # a CUDA-graph replay: the kernels ran, no op was dispatched
        kernels = backends_from_kernels(
            e.name() for e in events if str(e.device_type()).lower().endswith("cuda")
        )
    kernels = sorted(kernels)
    want = "cuda" if cuda else "cpu"
    allocs = sorted(
        (e.start_ns(), e.nbytes())
        for e in events
        if e.name() == "[memory]" and str(e.device_type()).lower().endswith(want)
    )
    if cuda:
        peak = torch.cuda.max_memory_allocated(device) - base
    else:
        running = peak = 0
        for _, nbytes in allocs:
            running += nbytes
            peak = max(peak, running)
    softmax_on_scores = any(
        "softmax" in e.name()
        and "backward" not in e.name()
        and any(math.prod(shape) == n_scores for shape in e.shapes() if shape)
        for e in events
    )
    ambiguous = {L, S} & {D, 2 * D, 3 * D}
    score_sized_alloc = not ambiguous and any(nbytes == n_scores * itemsize for _, nbytes in allocs)
    return ProbeResult(
        sdpa_kernel="+".join(kernels) or "none",
        peak_mem_mb=peak / 2**20,
        scores_materialized=softmax_on_scores or score_sized_alloc,
    )


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


# A point's probe and profiling pass, as its record's parts


def probe_point(point: Point, model, call, before) -> Probe:
    """What ran and what it held: the SDPA kernel, peak memory, whether the scores were
    materialised (under the caller's SDPA pin,
    harness/point/__init__.py, ``ready_to_time``)."""
    dims = (point.batch, point.num_heads, point.seq_len, point.kv_seq_len, point.head_dim)
    itemsize = torch.empty(0, dtype=point.torch_dtype).element_size()
    probed = probe(call, point.device, dims, itemsize, before)
    # No SDPA op ran: a variant that runs another attention kernel names it (attention=flex:
    # "flex"); a compiled FlexAttention leaves no op name of its own in the profile.
    kernel = probed.sdpa_kernel
    if kernel == "none" and getattr(model, "attention_kernel", None):
        kernel = model.attention_kernel
    return Probe(
        sdpa_kernel=kernel,
        peak_mem_mb=probed.peak_mem_mb,
        scores_materialized=probed.scores_materialized,
    )


def profile_point(
    point: Point, identity: Identity, call, before, trace_root: Path, job_num: int | None
) -> Profile:
    """The profiling pass, under the caller's SDPA pin (harness/point/__init__.py,
    ``ready_to_time``). Its failure is recorded in ``profile_error``; the row keeps its timing."""
    name = point_name(identity.columns(), job_num)
    try:
        result = run_profile(call, before, point.device, trace_root / name, name, point.profiler)
    except Exception as e:
        return Profile(profile_error=one_line(e))
    return Profile(
        trace_dir=f"{trace_root.name}/{name}",
        ops_per_call=result.ops_per_call,
        copies_per_call=result.copies_per_call,
        kernels_per_call=result.kernels_per_call,
        top_ops=result.top_ops,
        profile_error="",
    )
