"""One extra call of the timed callable under torch.profiler, after timing: what ran and
how much memory it took. Profiler overhead never enters the timing.

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
"""

from __future__ import annotations

import math
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile

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
