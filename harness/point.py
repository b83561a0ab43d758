"""Run one sweep point: build, check, time. Returns the row; never writes files.

A failure inside the point becomes the row's ``status`` and ``error`` (oom, unsupported,
error); only ``InvalidPoint`` escapes, because the caller decides what a bad value means
(a single run exits non-zero, a sweep records ``invalid`` and goes on).
"""

from __future__ import annotations

import torch

from harness import checks, timing
from harness.build import build_variant, maybe_compile
from harness.config import InvalidPoint, Point, VariantSpec
from harness.inputs import make_inputs, make_reference


def base_row(point: Point) -> dict:
    """The row's identity columns: what was asked, before anything ran."""
    return {
        "variant": point.variant.name,
        "variant_options": point.variant.options_str,
        "label": point.variant.label,
        "compile": point.compile,
        "batch": point.batch,
        "seq_len": point.seq_len,
        "kv_seq_len": point.kv_seq_len,
        "embed_dim": point.embed_dim,
        "num_heads": point.num_heads,
        "head_dim": point.head_dim,
        "dtype": point.dtype,
        "device": point.device,
        "mask": point.mask,
        "cross": point.cross,
        "bias": point.bias,
        "seed": point.seed,
        "torch_version": torch.__version__,
    }


def _classify(exc: BaseException) -> str:
    msg = str(exc)
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)) or any(
        s in msg.lower() for s in ("out of memory", "can't allocate memory")
    ):
        return "oom"
    if isinstance(exc, NotImplementedError) or "not implemented for" in msg or "No available kernel" in msg:
        return "unsupported"
    return "error"


def _one_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return " ".join(text.split())[:500]


def run_point(point: Point) -> dict:
    row = base_row(point)
    if point.device.startswith("cuda") and not torch.cuda.is_available():
        return {**row, "status": "unsupported", "error": f"device={point.device!r} but CUDA is not available"}

    try:
        reference64 = make_reference(point)  # float64, CPU: the oracle and the weights' source
        inputs64 = make_inputs(point)
        model = build_variant(point, reference64)
        inputs = inputs64.to(point.device, point.torch_dtype)
        reference = make_reference(point).to(point.device, point.torch_dtype)
        fn = maybe_compile(model, point.compile)
        with torch.no_grad():
            oracle_out, _ = reference64(inputs64.query, inputs64.key, inputs64.value, **inputs64.kwargs)
            ref_out, _ = reference(inputs.query, inputs.key, inputs.value, **inputs.kwargs)
            out, _ = fn(inputs.query, inputs.key, inputs.value, **inputs.kwargs)
        check = checks.compare("out", out, ref_out, oracle_out, point.dtype)
        row.update(
            check_passed=check.passed,
            max_abs_err=check.max_abs_err,
            max_rel_err=check.max_rel_err,
            ref_err=check.ref_err,
            tolerance=check.tolerance,
            worst_tensor=check.worst,
        )
        del reference, ref_out, out  # free before timing: only the timed call should hold memory

        q, k, v, kwargs = inputs.query, inputs.key, inputs.value, inputs.kwargs
        with torch.no_grad():
            result = timing.measure(lambda: fn(q, k, v, **kwargs), point.device, point.timing)
        row.update(
            latency_ms_median=result.median_ms,
            latency_ms_iqr=result.iqr_ms,
            n_samples=result.n_samples,
        )
        if not check.passed:
            row.update(status="mismatch", error=(
                f"{check.worst}: max_abs_err={check.max_abs_err:.3g} > tolerance={check.tolerance:.3g}"
            ))
        else:
            row.update(status="ok", error="")
    except InvalidPoint:
        raise  # the caller's to decide (see module doc)
    except Exception as e:  # one bad point must not end the sweep: record it and go on
        row.update(status=_classify(e), error=_one_line(e))
        if point.device.startswith("cuda"):
            torch.cuda.empty_cache()
    return row


def invalid_row(raw: dict, variant_name: str, message: str) -> dict:
    """Row for a point whose config did not validate: the values as given, status ``invalid``."""
    options = {k: v for k, v in (raw.get("variant") or {}).items() if k != "_target_"}
    spec = VariantSpec(variant_name, str((raw.get("variant") or {}).get("_target_")), options)
    row = {k: raw.get(k) for k in ("compile", "batch", "seq_len", "kv_seq_len", "embed_dim",
                                    "num_heads", "dtype", "device", "mask", "cross", "bias", "seed")}
    return {
        **row,
        "variant": variant_name,
        "variant_options": spec.options_str,
        "label": spec.label,
        "torch_version": torch.__version__,
        "status": "invalid",
        "error": message,
    }
