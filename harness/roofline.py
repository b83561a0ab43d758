"""How fast could it be? Datasheet peaks for common GPUs, and a measured dense-matmul peak.

Datasheet figures are dense (no 2:4 sparsity) tensor-core TFLOP/s for float16/bfloat16 and
plain (non-tensor-core) float32, since torch keeps TF32 off for matmuls by default. Matched by
substring of torch.cuda.get_device_name(), first match wins (so PCIe before the plain name).
"""

from __future__ import annotations

from harness.config import Timing
from harness.timing import measure

# (name substring, {dtype: dense TFLOP/s}) from NVIDIA's datasheets.
DATASHEET = [
    ("H100 PCIe", {"float32": 51.2, "float16": 756.0, "bfloat16": 756.0}),
    ("H100 NVL", {"float32": 60.0, "float16": 835.0, "bfloat16": 835.0}),
    ("H100", {"float32": 66.9, "float16": 989.4, "bfloat16": 989.4}),  # SXM
    ("H200", {"float32": 66.9, "float16": 989.4, "bfloat16": 989.4}),  # SXM
    ("GH200", {"float32": 66.9, "float16": 989.4, "bfloat16": 989.4}),
    ("A100", {"float32": 19.5, "float16": 312.0, "bfloat16": 312.0}),
    ("L40S", {"float32": 91.6, "float16": 362.1, "bfloat16": 362.1}),
    ("L4", {"float32": 30.3, "float16": 121.0, "bfloat16": 121.0}),
    ("A10G", {"float32": 31.2, "float16": 70.0, "bfloat16": 70.0}),
    ("A10", {"float32": 31.2, "float16": 125.0, "bfloat16": 125.0}),
    ("V100", {"float32": 15.7, "float16": 125.0}),
    ("T4", {"float32": 8.1, "float16": 65.0}),
]

# Matmul size for the measured peak: large enough to saturate the device, small enough to
# take well under a second per call on a 2-core CPU.
MATMUL_N = {"cuda": 8192, "cpu": 1024}
PEAK_TIMING = Timing(warmup=0.1, min_samples=5, min_time=0.3, max_time=1.0)


def datasheet_peak(device_name: str, dtype: str) -> float | None:
    for key, peaks in DATASHEET:
        if key in device_name:
            return peaks.get(dtype)
    return None


def measured_peak(device: str, dtype) -> tuple[float, int]:
    """TFLOP/s of one dense N x N x N matmul in ``dtype`` on ``device``, timed like a point."""
    import torch

    n = MATMUL_N["cuda" if device.startswith("cuda") else "cpu"]
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    with torch.no_grad():
        result = measure(lambda: torch.mm(a, b), device, PEAK_TIMING)
    return 2 * n**3 / (result.median_ms * 1e-3) / 1e12, n
