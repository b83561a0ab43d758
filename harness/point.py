"""Run one sweep point: build, check, time. Returns the row; never writes files.

A failure inside the point becomes the row's ``status`` and ``error`` (oom, unsupported,
error); only ``InvalidPoint`` escapes, because the caller decides what a bad value means
(a single run exits non-zero, a sweep records ``invalid`` and goes on).
"""

from __future__ import annotations

import torch

from harness import checks, timing
from harness.build import build_variant, maybe_compile
from harness.collect import collect
from harness.config import InvalidPoint, Point, VariantSpec
from harness.inputs import Inputs, make_inputs, make_reference


def base_row(point: Point) -> dict:
    """The row's identity columns: what was asked, before anything ran."""
    return {
        "variant": point.variant.name,
        "variant_options": point.variant.options_str,
        "label": point.variant.label,
        "compile": point.compile,
        "mode": point.mode,
        "batch": point.batch,
        "seq_len": point.seq_len,
        "kv_seq_len": point.kv_seq_len,
        "embed_dim": point.embed_dim,
        "num_heads": point.num_heads,
        "head_dim": point.head_dim,
        "dtype": point.dtype,
        "device": point.device,
        "mask": point.mask,
        "mask_format": point.mask_format,
        "need_weights": point.need_weights,
        "average_attn_weights": point.average_attn_weights,
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


def check_row(check: checks.CheckResult) -> dict:
    worst = check.worst
    return {
        "check_passed": check.passed,
        "max_abs_err": worst.max_abs_err,
        "max_rel_err": worst.max_rel_err,
        "ref_err": worst.ref_err,
        "err_ratio": worst.err_ratio,
        "tolerance": worst.tolerance,
        "worst_tensor": worst.name,
        "worst_index": str(worst.worst_index),
        "tensors_checked": len(check.tensors),
    }


def timed_call(model, fn, inputs: Inputs, mode: str):
    """The zero-argument callable to time and what to run before each sample, untimed."""
    q, k, v, kwargs, grad_out = inputs.query, inputs.key, inputs.value, inputs.kwargs, inputs.grad_out
    if mode == "fwd":
        def call():
            with torch.no_grad():
                return fn(q, k, v, **kwargs)
        return call, None

    leaves = list(inputs.named().values())

    def clear_grads():
        model.zero_grad(set_to_none=True)
        for t in leaves:
            t.grad = None

    def call():
        out, _ = fn(q, k, v, **kwargs)
        out.backward(grad_out)
    return call, clear_grads


def run_point(point: Point) -> dict:
    row = base_row(point)
    if point.device.startswith("cuda") and not torch.cuda.is_available():
        return {**row, "status": "unsupported", "error": f"device={point.device!r} but CUDA is not available"}
    grad = point.mode == "fwd_bwd"
    try:
        oracle_model = make_reference(point)  # float64, CPU: the oracle and the weights' source
        inputs64 = make_inputs(point)
        model = build_variant(point, oracle_model)
        reference = make_reference(point).to(point.device, point.torch_dtype)
        state = {k: v.to(point.device, point.torch_dtype) for k, v in oracle_model.state_dict().items()}
        fn = maybe_compile(model, point.compile)

        oracle = collect(oracle_model, oracle_model, inputs64.to("cpu", torch.float64, grad), point.mode,
                         oracle_model.state_dict())
        ref = collect(reference, reference, inputs64.to(point.device, point.torch_dtype, grad), point.mode, state)
        got = collect(model, fn, inputs64.to(point.device, point.torch_dtype, grad), point.mode, state)
        check = checks.compare(got, ref, oracle, point.dtype)
        row.update(check_row(check))
        del reference, ref, got, oracle  # free before timing: only the timed call should hold memory

        if not point.check_only:
            call, before = timed_call(model, fn, inputs64.to(point.device, point.torch_dtype, grad), point.mode)
            result = timing.measure(call, point.device, point.timing, before_sample=before)
            row.update(latency_ms_median=result.median_ms, latency_ms_iqr=result.iqr_ms,
                       n_samples=result.n_samples)
        if check.passed:
            row.update(status="ok", error="")
        else:
            w = check.worst
            row.update(status="mismatch", error=(
                f"{w.name}: max_abs_err={w.max_abs_err:.3g} > tolerance={w.tolerance:.3g} "
                f"at index {w.worst_index} ({w.err_ratio:.3g}x nn.MHA's own error)"))
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
    row = {k: raw.get(k) for k in ("compile", "mode", "batch", "seq_len", "kv_seq_len", "embed_dim",
                                    "num_heads", "dtype", "device", "mask", "mask_format", "need_weights",
                                    "average_attn_weights", "cross", "bias", "seed")}
    return {
        **row,
        "variant": variant_name,
        "variant_options": spec.options_str,
        "label": spec.label,
        "torch_version": torch.__version__,
        "status": "invalid",
        "error": message,
    }
