"""Time a zero-argument callable: warm-up by time, then samples until enough, median and IQR.

Set everything up first, then hand ``measure`` a ``lambda: model(q, k, v, ...)``: nothing but
the call sits in the timed region. On CUDA each sample is bracketed by a pair of CUDA events
(GPU time, no host overhead); on CPU by ``time.perf_counter``.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from harness.config import Timing


@dataclass(frozen=True)
class TimingResult:
    median_ms: float
    iqr_ms: float  # interquartile range (p75 - p25) of the samples
    n_samples: int


def _sample_cpu(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def _sample_cuda(fn: Callable[[], object]) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()  # the sample is read now so that the stopping rule can see it
    return start.elapsed_time(end)


def measure(fn: Callable[[], object], device: str, timing: Timing,
            before_sample: Callable[[], object] | None = None) -> TimingResult:
    """``before_sample`` runs before every call, outside the timed region (e.g. clear grads)."""
    cuda = device.startswith("cuda")
    prepare = before_sample or (lambda: None)
    sample = _sample_cuda if cuda else _sample_cpu
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    # Warm-up by time, not by count: the first calls pay for allocation, autotuning and
    # (with torch.compile) recompilation checks; two calls at least whatever the budget.
    start = time.perf_counter()
    calls = 0
    while calls < 2 or (time.perf_counter() - start) * 1e3 < timing.warmup_ms:
        prepare()
        fn()
        sync()
        calls += 1

    samples: list[float] = []
    start = time.perf_counter()
    while len(samples) < timing.max_samples and (
        len(samples) < timing.min_samples or (time.perf_counter() - start) * 1e3 < timing.max_time_ms
    ):
        prepare()
        samples.append(sample(fn))

    if len(samples) >= 2:
        q1, _, q3 = statistics.quantiles(samples, n=4, method="inclusive")
    else:
        q1 = q3 = samples[0]
    return TimingResult(median_ms=statistics.median(samples), iqr_ms=q3 - q1, n_samples=len(samples))
