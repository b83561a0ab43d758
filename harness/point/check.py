"""A point's check: the variant's first call against its shape's yardsticks (the float64 oracle
and nn.MHA in the point's dtype: harness/point/yardsticks.py), the float32 structure check, the
activation-scale check, and on a mismatch its diagnosis; the row's check columns and verdict.
docs/methodology.md, "How a point is checked".
"""

from __future__ import annotations

import dataclasses
import time

import torch

from harness import capabilities
from harness.build import build_variant, distributions, maybe_compile
from harness.check import checks
from harness.check import rows as sampling
from harness.check.collect import REPEATED, STEP2, collect, grouped
from harness.check.diagnose import Failed, explain
from harness.check.recheck import Recheck
from harness.check.scale import Unreachable
from harness.compiling import graph_shapes
from harness.config import Point
from harness.errors import classify, one_line
from harness.inputs import Inputs, cache_style, make_inputs, make_reference
from harness.measure.calls import (
    compiled_graphs,
    cudagraph_skips,
    replays_graphs,
    sdpa_context,
)
from harness.measure.footprint import check_fits
from harness.outcome import OK, Verdict, settle
from harness.point.yardsticks import Shelf, Yardsticks, called, key_of
from harness.results import ROUNDS_COLUMNS


@dataclasses.dataclass(frozen=True)
class Part:
    """What one stage of a point's check found: the columns it fills (docs/reference.md, "Result
    columns") and the verdict they imply. No stage writes the row: ``build_and_check`` puts each
    part on it, in order, and ``settle`` its verdict."""

    columns: dict
    verdict: Verdict = OK


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
        # every tensor over its tolerance, in the oracle's order: forward tensors, then gradients
        "failed_tensors": ";".join(t.name for t in check.tensors if not t.passed),
        "worst_index": str(worst.worst_index),
        "tensors_checked": len(check.tensors),
    }


def compare_to_oracle(point: Point, got: dict, ref: dict, oracle: dict, dtype: str, k=checks.K):
    """``checks.compare`` of a module's tensors (``collect``'s, as they came) with the yardsticks:
    grouped, the sampled query rows of the forward tensors where the check samples them, and
    each worst index in the whole sequence's rows."""
    result = checks.compare(sampling.compared(point, grouped(point, got)), ref, oracle, dtype, k)
    sample = sampling.sample(point)
    if sample is None:
        return result
    return checks.CheckResult(
        tuple(
            dataclasses.replace(t, worst_index=sample.in_sequence(t.name, t.worst_index))
            for t in result.tensors
        )
    )


def kept_check(prior: dict | None, row: dict) -> dict | None:
    """The columns of ``prior``, a row an earlier run of the sweep left for this point
    (``resume=true``), that still stand: its check, probe and profile, when it was ok and the
    variant's source file is unchanged (``variant_source_hash``). None: check it again."""
    if (
        not prior
        or prior.get("status") != "ok"
        or prior.get("variant_source_hash") != row.get("variant_source_hash")
    ):
        return None
    return {
        k: v for k, v in prior.items() if k not in ROUNDS_COLUMNS and k not in row and v is not None
    }


def check_point(
    point: Point, model, fn, oracle_model, inputs64: Inputs, ys: Yardsticks
) -> tuple[checks.CheckResult, list, Recheck, str, str | None, dict]:
    """The check: the variant's first call (it compiles, when compile is on) against nn.MHA in the
    point's dtype and the float64 oracle, and at a decode point the next step on the same cache.
    With check_only (the gate, where no call is timed) the first call
    is repeated once, after the rewind, before the next step (``collect``'s ``repeat``). Returns
    the result, the drop-in problems (an input changed in place, a wrong dtype or device), what the
    re-check after the rounds compares with, on a mismatch what explains it (``explain``), the
    repeated call's error (None: the same output, or none made) and the check's columns."""
    grad = point.mode == "fwd_bwd"
    state = {k: v.to(point.device, point.torch_dtype) for k, v in oracle_model.state_dict().items()}
    oracle = ys.oracle(point, inputs64, oracle_model)
    ref = ys.reference(point, inputs64, state)
    columns = {"checked_rows": sampling.column(sampling.sample(point))}
    graphs, skips, t0 = compiled_graphs(), cudagraph_skips(), time.perf_counter()
    checked = sampling.masked(point, inputs64).to(point.device, point.torch_dtype, grad)
    given = checked.given()
    with sdpa_context(point.sdpa_backend):
        got = collect(model, fn, checked, point.mode, state, repeat=point.check_only)
    again = got.pop(REPEATED, None)
    graphs = compiled_graphs() - graphs
    columns["cuda_graphs"] = replays_graphs(point, cudagraph_skips() - skips)
    # compile=..., or a variant that compiles inside (attention=flex)
    if point.compile != "off" or graphs:
        columns.update(compile_s=time.perf_counter() - t0, compiled_graphs=graphs)
    if point.compile != "off":
        columns["compiled_shapes"] = graph_shapes(fn)
    check = compare_to_oracle(point, got, ref, oracle, point.dtype)
    out = next(t for t in check.tensors if t.name == "out")
    recheck = Recheck(got["out"].clone(), out.tolerance, point.device)
    repeat = None if again is None else recheck.repeated(again)
    if repeat and any(name.startswith(STEP2) for name in oracle):
        # the second step followed the repeated call, whose state it inherits: compared no more
        def first(tensors: dict) -> dict:
            return {k: v for k, v in tensors.items() if not k.startswith(STEP2)}

        check = compare_to_oracle(point, first(got), first(ref), first(oracle), point.dtype)
    problems = checks.drop_in(got, ref, checked.changed(given))
    columns.update(check_row(check))
    if problems:
        columns["check_passed"] = False
    explained, said = diagnosed(point, oracle_model, inputs64, got, check, oracle, ref)
    columns.update(explained)
    # got and the inputs are freed here: only the timed call (and the checked output, for the
    # re-check: a copy, which the activation-scale call cannot overwrite when a module reuses its
    # output buffer, as a CUDA graph does) should hold memory
    return check, problems, recheck, said, repeat, columns


def diagnosed(point: Point, oracle_model, inputs64, got, check, oracle, ref) -> tuple[dict, str]:
    """On a failed check, outside any timing: which known mistake the module computes and where
    its error is (harness/check/diagnose.py): its columns and the sentence for its error.
    Nothing on a passed check."""
    if check.passed:
        return {}, ""
    try:
        got = sampling.compared(point, grouped(point, got))  # as the check compared them
        return explain(Failed(point, oracle_model, inputs64, got, check, oracle, ref))
    except Exception as e:  # the verdict stands without its explanation
        return {"diagnosis": f"error: {one_line(e)}"}, f"Diagnosis: failed ({one_line(e)})."


def check_float32(point: Point, oracle_model, inputs64: Inputs, ys: Yardsticks) -> Part:
    """The structure check of a float16 or bfloat16 point: the module built in float32 at the
    same shape, checked against the same oracle with float32's tolerance, so that a mask or
    window one key off cannot hide in half precision's (docs/methodology.md). Eager, with the
    point's SDPA pin. Its part: ``fp32_check`` and ``fp32_check_s`` (and on a mismatch the
    diagnosis), and the verdict it implies (empty: it passed, or cannot run in float32, which
    the column says)."""
    t0 = time.perf_counter()
    point32, _, unsupported = capabilities.apply(
        dataclasses.replace(point, dtype="float32", compile="off")
    )
    verdict, columns = OK, {}
    if unsupported or point32.dtype != "float32":
        columns["fp32_check"] = (
            f"unsupported: {unsupported or 'the variant fixes dtype=' + point32.dtype}"
        )
    else:
        state = {k: v.to(point.device, torch.float32) for k, v in oracle_model.state_dict().items()}
        try:
            model32 = build_variant(point32, oracle_model)
            if key_of(point32) != ys.key:  # the variant's declarations changed the shape
                ys = Yardsticks(key_of(point32), ys.fingerprint)
            oracle = ys.oracle(point32, inputs64, oracle_model)
            ref = ys.reference(point32, inputs64, state)
            with sdpa_context(point.sdpa_backend):
                got = called(point32, model32, model32, inputs64, state)
            check = compare_to_oracle(point, got, ref, oracle, "float32")
        except (Exception, SystemExit) as e:  # a kernel that runs no float32 here, say
            columns["fp32_check"] = f"{classify(e)}: {one_line(e)}"
        else:
            columns["fp32_check"] = "ok" if check.passed else "mismatch"
            if not check.passed:
                said = check_status(check, []).error
                explained, why = diagnosed(point32, oracle_model, inputs64, got, check, oracle, ref)
                columns.update(explained)
                verdict = Verdict(
                    "mismatch",
                    f"in float32 (the structure check; {point.dtype} passed within its "
                    f"tolerance): {said}. {why}",
                )
    columns["fp32_check_s"] = time.perf_counter() - t0
    return Part(columns, verdict)


def check_activation_scale(
    point: Point, model, fn, oracle_model, inputs64: Inputs, ys: Yardsticks
) -> Part:
    """The activation-scale check: the variant's call once more, on the point's inputs with a
    few outlier channels scaled up until nn.MHA's largest logit is ``check_max_logit``
    (harness/check/scale.py), against the oracle and nn.MHA at those inputs, with the same
    tolerance rule but K_ACTIVATION (docs/methodology.md, Two scales). Its part: ``act_check``,
    ``act_check_s``, ``act_max_logit``, ``act_scale`` and ``act_err_ratio`` (on a mismatch the
    check's columns at that scale and its diagnosis), and the verdict it implies (empty: it
    passed, is off, or cannot reach the logit)."""
    if point.check_max_logit is None:
        return Part({"act_check": "off"})
    t0 = time.perf_counter()
    verdict = OK
    try:
        scale = ys.scale(point, oracle_model, inputs64)
    except Unreachable as e:  # the point's weights, not the variant
        return Part({"act_check": f"not run: {e}", "act_check_s": time.perf_counter() - t0})
    inputs = ys.scaled(inputs64, scale)  # this point's own inputs (its cache style), scaled
    columns = {"act_max_logit": scale.max_logit, "act_scale": scale.factor}
    state = {k: v.to(point.device, point.torch_dtype) for k, v in oracle_model.state_dict().items()}
    oracle = ys.oracle(point, inputs64, oracle_model, scale)
    ref = ys.reference(point, inputs64, state, scale)
    try:  # the variant's call: what fails here is the variant's
        with sdpa_context(point.sdpa_backend):
            got = called(point, model, fn, inputs, state)
        check = compare_to_oracle(point, got, ref, oracle, point.dtype, checks.K_ACTIVATION)
    except (Exception, SystemExit) as e:
        status, said = classify(e), one_line(e)
        columns["act_check"] = f"{status}: {said}"
        if status not in ("unsupported", "oom"):  # it runs at unit scale and fails here
            verdict = Verdict(status, f"at activation scale: {said}")
    else:
        spoiled = [f"{t.name} ({t.ref_nonfinite})" for t in check.tensors if t.ref_nonfinite]
        note = (
            f" (nn.MHA itself non-finite, not compared there: {', '.join(spoiled)} elements)"
            if spoiled
            else ""
        )
        columns["act_check"] = ("ok" if check.passed else "mismatch") + note
        columns["act_err_ratio"] = check.worst.err_ratio
        if not check.passed:
            w = named_first(check)
            said = check_status(check, []).error
            if w.problem.startswith("NaN/Inf"):
                said = f"non-finite {w.name} ({scale.describe()}; nn.MHA finite there): {said}"
            else:
                said = f"{scale.describe()}: {said}"
            explained, why = diagnosed(point, oracle_model, inputs, got, check, oracle, ref)
            verdict = Verdict("mismatch", f"at activation scale, {said}. {why}")
            columns.update(explained, **check_row(check), failed_scale="activation")
    columns["act_check_s"] = time.perf_counter() - t0
    return Part(columns, verdict)


def named_first(check: checks.CheckResult) -> checks.TensorCheck:
    """The tensor a failed check's error names: the first forward tensor over its tolerance (out,
    attn_weights, step2_out, in the oracle's order), else the worst (a gradient): a wrong output
    is said first, though a gradient it feeds may be further over its own tolerance."""
    forward = [t for t in check.tensors if not t.passed and "grad_" not in t.name]
    return forward[0] if forward else check.worst


def check_status(check: checks.CheckResult, problems: list) -> Verdict:
    """The verdict of a check (``settle`` puts it on the row)."""
    if problems:  # not a drop-in, whatever the numbers say
        return Verdict("mismatch", "; ".join(problems))
    if check.passed:
        return OK
    w = named_first(check)
    return Verdict(
        "mismatch",
        f"{w.name}: {w.problem} (first at index {w.worst_index})"
        if w.problem
        else f"{w.name}: max_abs_err={w.max_abs_err:.3g} > tolerance={w.tolerance:.3g} "
        f"at index {w.worst_index} ({w.err_ratio:.3g}x nn.MHA's own error)",
    )


def build_and_check(point: Point, row: dict, prior: dict | None, shelf: Shelf | None = None):
    """Build the variant with nn.MHA's weights and check it (or keep the check of
    ``prior``, resume) against its shape's yardsticks (``shelf``'s: the last shape's kept; None:
    a shelf of its own); the row gets its check columns and verdict. Returns (model, the
    callable to time, the float64 inputs, the kept columns or None, what the re-check compares
    with)."""
    row["mem_estimate_mb"] = check_fits(point) / 2**20  # before anything is allocated
    oracle_model = make_reference(point)  # float64, CPU: the oracle and the weights' source
    inputs64 = make_inputs(point)
    model = build_variant(point, oracle_model)
    row["variant_distribution"] = distributions(model, row["variant_distribution"])
    if point.kv_cache_len is not None:
        row["kv_cache"] = cache_style(model, point.kv_cache)
    fn = maybe_compile(model, point.compile)
    kept = None if point.check_only else kept_check(prior, row)
    recheck = None
    if kept is None:
        t0 = time.perf_counter()
        ys = (shelf or Shelf()).at(point)
        check, problems, recheck, why, repeat, columns = check_point(
            point, model, fn, oracle_model, inputs64, ys
        )
        verdict = check_status(check, problems)
        if why:
            verdict = Verdict(verdict.status, f"{verdict.error}. {why}")
        row.update(columns)
        settle(row, verdict)
        if repeat:
            settle(row, Verdict("mismatch", repeat))
        # the checks at other scales ask more of a passing module: each runs while it passes
        later = [lambda: check_activation_scale(point, model, fn, oracle_model, inputs64, ys)]
        if point.torch_dtype in (torch.float16, torch.bfloat16):
            later.append(lambda: check_float32(point, oracle_model, inputs64, ys))
        for stage in later:
            if row["status"] != "ok":
                break
            part = stage()
            row.update(part.columns)
            settle(row, part.verdict)
        if row["status"] == "mismatch":  # the point's own inputs (or float32's), unless said
            row.setdefault("failed_scale", "unit")
        row["check_s"] = time.perf_counter() - t0
    else:  # resume: the earlier run's check, probe and profile stand
        row.update(kept)
    return model, fn, inputs64, kept, recheck
