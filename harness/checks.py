"""Does the variant compute what nn.MultiheadAttention computes? Numbers first, verdict second.

Both the variant and nn.MultiheadAttention run in the point's dtype and are compared with a
float64 nn.MultiheadAttention (the oracle) on the same weights and inputs. The variant passes
when its error is within ``max(ATOL[dtype], K * ref_err)``: at most K times the error PyTorch's
own implementation makes in that dtype (flash-attention's test rule), with an absolute floor
for the cases where the reference happens to be nearly exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# K: a correct variant may order its arithmetic differently (SDPA vs matmul+softmax, fused vs
# split projections), which on the inputs we draw changes the error by ~1-3x; the mistakes we
# must catch (wrong scale, unpermuted heads, dropped bias) are off by orders of magnitude.
K = 4.0
# Floors, about 8-16 ulps at the output's magnitude (~1): below these differences are rounding.
ATOL = {"float32": 1e-5, "float16": 4e-3, "bfloat16": 3e-2}


@dataclass(frozen=True)
class CheckResult:
    passed: bool
    max_abs_err: float  # max |variant - oracle|
    max_rel_err: float  # max_abs_err / max |oracle| (normwise: elementwise ratios blow up near 0)
    ref_err: float  # max |nn.MHA in dtype - oracle|
    tolerance: float  # max(ATOL[dtype], K * ref_err)
    worst: str  # name of the tensor with the largest error relative to its tolerance


def _max_abs_err(actual: torch.Tensor, oracle: torch.Tensor) -> float:
    if actual.shape != oracle.shape:
        return float("inf")
    diff = (actual.double().cpu() - oracle.double().cpu()).abs()
    # NaN or Inf where the oracle is finite is an infinite error, never a silent pass.
    return float("inf") if not torch.isfinite(diff).all() else diff.max().item() if diff.numel() else 0.0


def compare(name: str, actual: torch.Tensor, reference: torch.Tensor, oracle: torch.Tensor,
            dtype: str) -> CheckResult:
    err = _max_abs_err(actual, oracle)
    ref_err = _max_abs_err(reference, oracle)
    tol = max(ATOL[dtype], K * ref_err)
    scale = oracle.abs().max().item() if oracle.numel() else 0.0
    return CheckResult(
        passed=err <= tol,
        max_abs_err=err,
        max_rel_err=err / scale if scale > 0 else err,
        ref_err=ref_err,
        tolerance=tol,
        worst=name,
    )
