"""How fast could it be? Datasheet peaks for common GPUs, and a measured dense-matmul peak.

Datasheet figures are dense (no 2:4 sparsity) tensor-core TFLOP/s for float16/bfloat16 (with
float32 accumulation, what PyTorch's matmuls use) and plain (non-tensor-core) float32, since
torch keeps TF32 off for matmuls by default. A device is matched by its whole name (never a
substring: "L40" is not an "L4"), and only when it has all of the model's SMs: a MIG slice or a
partitioned GPU has a fraction of the datasheet's peak, so it gets none (the measured peak still
applies).
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
from pathlib import Path
from typing import Callable, ContextManager

import torch

from harness.envinfo import device_name
from harness.files import atomic_write_text
from harness.measure.peakfile import read_peaks
from harness.measure.timing import Window, measure

log = logging.getLogger("harness")

# (model, name pattern, SMs, {dtype: dense TFLOP/s}) from NVIDIA's datasheets. The pattern is
# matched against the whole of torch.cuda.get_device_name() less "NVIDIA ", "Tesla ", "GeForce ".
_SXM_H = {"float32": 66.9, "float16": 989.4, "bfloat16": 989.4}
_NVL_H = {"float32": 60.0, "float16": 835.5, "bfloat16": 835.5}
DATASHEET = [
    ("H100 SXM", r"H100( SXM5?)?( \d+GB)?( HBM3)?", 132, _SXM_H),
    ("H100 PCIe", r"H100 PCIe", 114, {"float32": 51.2, "float16": 756.5, "bfloat16": 756.5}),
    ("H100 NVL", r"H100 NVL", 132, _NVL_H),
    ("H200 SXM", r"H200( SXM)?( \d+GB)?( HBM3e)?", 132, _SXM_H),
    ("H200 NVL", r"H200 NVL", 132, _NVL_H),
    ("GH200", r"GH200( \d+GB)?", 132, _SXM_H),
    ("A100", r"A100([- ][\w -]+)?", 108, {"float32": 19.5, "float16": 312.0, "bfloat16": 312.0}),
    ("L4", r"L4", 58, {"float32": 30.3, "float16": 121.0, "bfloat16": 121.0}),
    ("L40", r"L40", 142, {"float32": 90.5, "float16": 181.0, "bfloat16": 181.0}),
    ("L40S", r"L40S", 142, {"float32": 91.6, "float16": 362.1, "bfloat16": 362.1}),
    ("RTX 4090", r"RTX 4090", 128, {"float32": 82.6, "float16": 165.2, "bfloat16": 165.2}),
    ("A10G", r"A10G", 80, {"float32": 31.2, "float16": 70.0, "bfloat16": 70.0}),
    ("A10", r"A10", 72, {"float32": 31.2, "float16": 125.0, "bfloat16": 125.0}),
    ("V100", r"V100(-\w+)*", 80, {"float32": 15.7, "float16": 125.0}),
    ("T4", r"T4", 40, {"float32": 8.1, "float16": 65.0}),
]


def datasheet_model(name: str, sms: int | None = None) -> tuple[str, dict] | None:
    """The datasheet entry a device is, by its whole name; None when it is none of them, is a
    MIG slice, or has fewer SMs (``sms``, when known) than the model."""
    bare = re.sub(r"^(NVIDIA |Tesla |GeForce )+", "", name.strip())
    if "MIG" in bare.split():
        return None
    for model, pattern, model_sms, peaks in DATASHEET:
        if re.fullmatch(pattern, bare):
            if sms is not None and sms < model_sms:
                return None
            return model, peaks
    return None


def datasheet_peak(name: str, dtype: str, sms: int | None = None) -> float | None:
    entry = datasheet_model(name, sms)
    return entry[1].get(dtype) if entry else None


def device_sms(device: str) -> int | None:
    """The SMs the process can use on ``device`` (a MIG slice has fewer); None off CUDA."""
    if not device.startswith("cuda") or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(torch.device(device)).multi_processor_count


# The measured peak is the best of several dense matmuls: sizes and operand layouts (a
# transposed operand is what nn.Linear and attention's Q.K^T run), each timed briefly. One size
# and layout alone is beaten by kernels that happen to hit a faster path (bfloat16 on CPU reached
# 120% of a single 1024^3 torch.mm), so a % of it would be meaningless.
MATMUL_SIZES = {"cuda": (4096, 8192), "cpu": (512, 1024)}
LAYOUTS = {
    "NN": lambda a, b: torch.mm(a, b),
    "NT": lambda a, b: torch.mm(a, b.t()),
    "TN": lambda a, b: torch.mm(a.t(), b),
}
PEAK_TIMING = Window(warmup=0.02, min_samples=3, min_time=0.05, max_time=0.25)


def measured_peak(device: str, dtype, only: str | None = None) -> tuple[float, str]:
    """The best TFLOP/s of dense N x N x N matmuls in ``dtype`` on ``device`` over the sizes and
    layouts above, and which one it was (``torch.mm 1024x1024 NT``). ``only``, such a name:
    that matmul alone (a re-measurement of the winner, far cheaper than all of them; figures in
    docs/measurements.md)."""
    best = (0.0, "")
    sizes = MATMUL_SIZES["cuda" if device.startswith("cuda") else "cpu"]
    if only not in {f"torch.mm {n}x{n} {name}" for n in sizes for name in LAYOUTS}:
        only = None  # not one of ours (another device's, or an older name): every one
    for n in sizes:
        names = [name for name in LAYOUTS if only in (None, f"torch.mm {n}x{n} {name}")]
        if not names:
            continue
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        for name in names:
            mm = LAYOUTS[name]
            with torch.no_grad():
                result = measure(lambda: mm(a, b), device, PEAK_TIMING)
            best = max(
                best, (2 * n**3 / (result.median_ms * 1e-3) / 1e12, f"torch.mm {n}x{n} {name}")
            )
    return best


# The copy bandwidth: a large copy_ timed like the matmul peak, reads + writes counted (what a
# decode step's bytes are measured against). Larger than the last-level caches.
COPY_BYTES = {"cuda": 2**30, "cpu": 2**28}


def measured_copy(device: str) -> tuple[float, str]:
    """GB/s of ``dst.copy_(src)`` on ``device`` (median call), counting bytes read and written."""
    n = COPY_BYTES["cuda" if device.startswith("cuda") else "cpu"]
    src = torch.empty(n, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    result = measure(lambda: dst.copy_(src), device, PEAK_TIMING)
    return 2 * n / (result.median_ms * 1e-3) / 1e9, f"copy_ {n // 2**20} MiB"


class PeakBook:
    """``peak.json`` at the run/sweep root: per device and dtype, the measured peak that every
    point's ``pct_of_peak`` divides by. Measured once per sweep; when a point's throughput beats
    it, measured again, and if the point still beats it the point's own rate becomes the peak
    (with its source): a % of peak above 100 would say the yardstick is wrong, not the kernel.
    ``path=None`` keeps it in memory (``run_point`` from Python)."""

    def __init__(self, path: Path | None = None):
        self.path = path
        self.peaks: dict = {}
        self.remeasured: set[str] = set()
        # Wraps each measurement: the worker tells its job process that these seconds are the
        # harness's, not the point's (point_timeout).
        self.around: Callable[[], ContextManager] = contextlib.nullcontext

    @staticmethod
    def key(point) -> str:
        return f"{device_name(point.device)} | {point.device} | {point.dtype}"

    def _load(self) -> None:
        self.peaks.update(read_peaks(self.path))

    def _save(self) -> None:
        if self.path is not None:
            atomic_write_text(self.path, json.dumps(self.peaks, indent=2))

    def _measure(self, point, key: str, only: str | None = None) -> None:
        torch.set_num_threads(point.num_threads)
        with self.around():
            tflops, source = measured_peak(point.device, point.torch_dtype, only)
        old = self.peaks.get(key, {}).get("tflops", 0.0)
        if tflops > old:
            self.peaks[key] = {"tflops": tflops, "source": source, "num_threads": point.num_threads}
        log.info(f"measured peak: {tflops:.3g} TFLOP/s ({source}, {key})")

    def get(self, point) -> float | None:
        """The peak for the point's device and dtype, measured if this sweep has none yet."""
        key = self.key(point)
        self._load()
        if key not in self.peaks:
            if point.device.startswith("cuda") and not torch.cuda.is_available():
                return None
            try:
                self._measure(point, key)
            except Exception as e:  # no peak is no reason to lose the point
                log.warning(f"peak measurement failed for {key}: {e}")
                return None
            self._save()
        return self.peaks[key]["tflops"]

    def bandwidth(self, point) -> float | None:
        """The device's measured copy bandwidth in GB/s (decode points), once per sweep."""
        key = f"{device_name(point.device)} | {point.device} | copy"
        self._load()
        if key not in self.peaks:
            try:
                with self.around():
                    gbps, source = measured_copy(point.device)
            except Exception as e:  # no bandwidth is no reason to lose the point
                log.warning(f"copy bandwidth measurement failed for {key}: {e}")
                return None
            self.peaks[key] = {"gbps": gbps, "source": source}
            log.info(f"measured copy bandwidth: {gbps:.3g} GB/s ({source}, {key})")
            self._save()
        return self.peaks[key]["gbps"]

    def beaten(self, point, tflops: float, who: str) -> float:
        """A point reached ``tflops``, above the peak: measure again (once per sweep), and keep
        the point's rate as the peak if it is still above."""
        key = self.key(point)
        self._load()
        if key not in self.remeasured:
            self.remeasured.add(key)
            source = self.peaks.get(key, {}).get("source", "")
            try:  # the matmul that won the first time, again (all of them when none is recorded)
                self._measure(point, key, only=source if source.startswith("torch.mm ") else None)
            except Exception as e:
                log.warning(f"peak re-measurement failed for {key}: {e}")
        if tflops > self.peaks.get(key, {}).get("tflops", 0.0):
            self.peaks[key] = {
                "tflops": tflops,
                "source": f"achieved by {who}",
                "num_threads": point.num_threads,
            }
        self._save()
        return self.peaks[key]["tflops"]


class FixedPeak(PeakBook):
    """A peak given, not measured (``run_point(peak_tflops=...)``), or none: the same questions
    as a ``PeakBook``, answered with it (no copy bandwidth)."""

    def __init__(self, tflops: float | None = None):
        super().__init__(None)
        self.tflops = tflops

    def get(self, point) -> float | None:
        return self.tflops

    def bandwidth(self, point) -> float | None:
        return None

    def beaten(self, point, tflops: float, who: str) -> float | None:
        return self.tflops


def book(peaks: PeakBook | float | None) -> PeakBook:
    """The peaks a point's throughput is set against: a sweep's ``PeakBook``, or a fixed peak in
    TFLOP/s, or none."""
    return peaks if isinstance(peaks, PeakBook) else FixedPeak(peaks)
