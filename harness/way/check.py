"""A point's check: the variant's first call against its shape's yardsticks (the float64 oracle
and nn.MHA in the point's dtype: harness/way/yardsticks.py), the float32 structure check, the
activation-scale check, and on a mismatch its diagnosis: the record's ``Check`` and ``Diagnosis``
parts and their verdicts.
docs/methodology.md, "How a point is checked".
"""

from __future__ import annotations

import dataclasses
import time
from typing import NamedTuple

import torch

from harness.way import capabilities
from harness.way.build import build_variant, built, rounded_note
from harness.way import checks
from harness.way.calls import STEP2, Called, Inputs, called
from harness.way.compared import column, key_of
from harness.way.diagnose import Failed, explain
from harness.way.recheck import Recheck
from harness.way.scale import Unreachable
from harness.way.compiling import compiled_graphs, cudagraph_skips, graph_shapes, replays_graphs
from harness.config import Point
from harness.errors import classify, one_line
from harness.way.inputs import make_inputs, make_reference
from harness.way.footprint import check_fits, materialises_scores
from harness.outcome import OK, Verdict, noted
from harness.way.checks import At
from harness.way.yardsticks import Shelf, Yardsticks
from harness.schema import Probe, Profile, Record, check_stands
from harness.schema_check import Check, Diagnosis


@dataclasses.dataclass(frozen=True)
class Stage:
    """What one stage of a point's check found: its part of the record's ``Check`` (the fields it
    fills), a diagnosis where it explained a mismatch, and the verdict they imply. No stage
    touches the record: ``build_and_check`` merges each stage's parts into it, in order, and
    settles its verdict."""

    check: Check
    diagnosis: Diagnosis | None = None
    verdict: Verdict = OK


class Checked(NamedTuple):
    """A point built and checked (``build_and_check``): what its timing needs."""

    model: object  # the variant's module
    fn: object  # the callable to time: the module, or torch.compile over it
    inputs64: Inputs  # the point's inputs, float64 on the CPU
    kept: "Kept | None"  # what a resumed point kept of its earlier row, or None
    recheck: Recheck | None  # what the re-check after the rounds compares with (None: kept)


@dataclasses.dataclass(frozen=True)
class Kept:
    """What a resumed point keeps of its earlier row (``kept_check``): the parts the rounds do not
    redo."""

    check: Check
    diagnosis: Diagnosis
    probe: Probe
    profile: Profile


def compared_part(check: checks.CheckResult) -> Check:
    """The comparison's fields of the ``Check`` part: the worst tensor against its tolerance."""
    worst = check.worst
    return Check(
        check_passed=check.passed,
        max_abs_err=worst.max_abs_err,
        max_rel_err=worst.max_rel_err,
        ref_err=worst.ref_err,
        err_ratio=worst.err_ratio,
        tolerance=worst.tolerance,
        worst_tensor=worst.name,
        # every tensor over its tolerance, in the oracle's order: forward tensors, then gradients
        failed_tensors=";".join(t.name for t in check.tensors if not t.passed),
        worst_index=str(worst.worst_index),
        tensors_checked=len(check.tensors),
    )


def kept_check(prior: dict | None, source_hash: str | None) -> Kept | None:
    """The parts of ``prior``, the row an earlier run of the sweep left for this point
    (``resume=true``), that still stand: its check, probe and profile, when it was ok and the
    variant's source file is unchanged (``variant_source_hash``). None: check it again."""
    if not check_stands(prior, source_hash):
        return None
    return Kept(Check.of(prior), Diagnosis.of(prior), Probe.of(prior), Profile.of(prior))


def compared_call(
    point: Point, at: At, rows, model, fn, inputs: Inputs, state: dict, k=checks.K, repeat=False
) -> tuple[Called, checks.CheckResult]:
    """The variant's call on ``inputs`` as the check compares it (``called``: ``rows`` sampled),
    and its comparison with ``at`` under the tolerance factor ``k``: every stage's one way to ask
    a module for an answer and judge it."""
    got = called(point, rows, model, fn, inputs, state, repeat=repeat)
    return got, at.compare(got.tensors, point.dtype, k)


def check_point(
    point: Point, model, fn, oracle_model, inputs64: Inputs, ys: Yardsticks
) -> tuple[checks.CheckResult, list, Recheck, str | None, Stage]:
    """The check: the variant's first call (it compiles, when compile is on) against nn.MHA in the
    point's dtype and the float64 oracle, and at a decode point the next step on the same cache.
    With check_only (the gate, where no call is timed) the first call
    is repeated once, after the rewind, before the next step (``collect``'s ``repeat``). Returns
    the result, the drop-in problems (an input changed in place, a wrong dtype or device), what the
    re-check after the rounds compares with, the repeated call's error (None: the same output, or
    none made) and the stage: its ``Check`` fields, on a mismatch what explains it (``explain``),
    and its verdict."""
    state = {k: v.to(point.device, point.torch_dtype) for k, v in oracle_model.state_dict().items()}
    at = ys.at(point, oracle_model, inputs64, state)
    graphs, skips = compiled_graphs(), cudagraph_skips()
    got, check = compared_call(
        point, at, ys.sample, model, fn, inputs64, state, repeat=point.check_only
    )
    compared = got.tensors
    graphs = compiled_graphs() - graphs
    compiled = Check(
        checked_rows=column(ys.sample),
        cuda_graphs=replays_graphs(point, cudagraph_skips() - skips),
    )
    # compile=..., or a variant that compiles inside (attention=flex)
    if point.compile != "off" or graphs:
        compiled = dataclasses.replace(compiled, compile_s=got.seconds, compiled_graphs=graphs)
    if point.compile != "off":
        compiled = dataclasses.replace(compiled, compiled_shapes=graph_shapes(fn))
    out = next(t for t in check.tensors if t.name == "out")
    recheck = Recheck(got.out.clone(), out.tolerance, point.device)
    repeat = None if got.again is None else recheck.repeated(got.again)
    if repeat and any(name.startswith(STEP2) for name in at.oracle):
        # the second step followed the repeated call, whose state it inherits: compared no more
        at = at.first_step()
        first = {k: v for k, v in compared.items() if not k.startswith(STEP2)}
        check = at.compare(first, point.dtype)
    problems = checks.drop_in(compared, at.ref, got.changed)
    part = compiled.merged(compared_part(check))
    if problems:
        part = dataclasses.replace(part, check_passed=False)
    diagnosis, said = diagnosed(point, oracle_model, inputs64, compared, check, at)
    verdict = check_status(check, problems)
    if said:
        verdict = Verdict(verdict.status, f"{verdict.error}. {said}")
    # got and the inputs are freed here: only the timed call (and the checked output, for the
    # re-check: a copy, which the activation-scale call cannot overwrite when a module reuses its
    # output buffer, as a CUDA graph does) should hold memory
    return check, problems, recheck, repeat, Stage(part, diagnosis, verdict)


def diagnosed(
    point: Point, oracle_model, inputs64, got, check, at: At
) -> tuple[Diagnosis | None, str]:
    """On a failed check, outside any timing: which known mistake the module computes and where
    its error is (harness/way/diagnose.py), from its tensors as the check compared them
    (``comparable``): its part and the sentence for its error. Nothing on a passed check."""
    if check.passed:
        return None, ""
    try:
        return explain(Failed(point, oracle_model, inputs64, got, check, at.oracle, at.sample))
    except Exception as e:  # the verdict stands without its explanation
        return Diagnosis(diagnosis=f"error: {one_line(e)}"), f"Diagnosis: failed ({one_line(e)})."


def check_float32(point: Point, oracle_model, inputs64: Inputs, ys: Yardsticks) -> Stage:
    """The structure check of a float16 or bfloat16 point: the module built in float32 at the
    same shape, checked against the same oracle with float32's tolerance, so that a mask or
    window one key off cannot hide in half precision's (docs/methodology.md). Eager, with the
    point's SDPA pin. Its stage: ``fp32_check`` and ``fp32_check_s`` (and on a mismatch the
    diagnosis), and the verdict it implies (ok: it passed, or cannot run in float32, which the
    column says)."""
    t0 = time.perf_counter()
    point32, _, unsupported, _, cls = capabilities.apply(
        dataclasses.replace(point, dtype="float32", compile="off")
    )
    verdict, diagnosis = OK, None
    if unsupported or point32.dtype != "float32":
        said = f"unsupported: {unsupported or 'the variant fixes dtype=' + point32.dtype}"
    else:
        state = {k: v.to(point.device, torch.float32) for k, v in oracle_model.state_dict().items()}
        try:
            model32 = build_variant(point32, oracle_model, cls)
            key = key_of(point32)
            if key != ys.key:  # the variant's declarations changed the shape
                ys = Yardsticks(key, ys.fingerprint)
            at = ys.at(point32, oracle_model, inputs64, state)
            answer, check = compared_call(point32, at, ys.sample, model32, model32, inputs64, state)
            got = answer.tensors
        except (Exception, SystemExit) as e:  # a kernel that runs no float32 here, say
            said = f"{classify(e)}: {one_line(e)}"
        else:
            said = "ok" if check.passed else "mismatch"
            if not check.passed:
                error = check_status(check, []).error
                diagnosis, why = diagnosed(point32, oracle_model, inputs64, got, check, at)
                verdict = Verdict(
                    "mismatch",
                    f"in float32 (the structure check; {point.dtype} passed within its "
                    f"tolerance): {error}. {why}",
                )
    part = Check(fp32_check=said, fp32_check_s=time.perf_counter() - t0)
    return Stage(part, diagnosis, verdict)


def check_activation_scale(
    point: Point, model, fn, oracle_model, inputs64: Inputs, ys: Yardsticks
) -> Stage:
    """The activation-scale check: the variant's call once more, on the point's inputs with a
    few outlier channels scaled up until nn.MHA's largest logit is ``check_max_logit``
    (harness/way/scale.py), against the oracle and nn.MHA at those inputs, with the same
    tolerance rule but K_ACTIVATION (docs/methodology.md, Two scales). Its stage: ``act_check``,
    ``act_check_s``, ``act_max_logit``, ``act_scale`` and ``act_err_ratio`` (on a mismatch the
    comparison at that scale and its diagnosis), and the verdict it implies (ok: it passed, is
    off, or cannot reach the logit)."""
    if point.check_max_logit is None:
        return Stage(Check(act_check="off"))
    t0 = time.perf_counter()
    try:
        scale = ys.scale(point, oracle_model, inputs64)
    except Unreachable as e:  # the point's weights, not the variant
        return Stage(Check(act_check=f"not run: {e}", act_check_s=time.perf_counter() - t0))
    inputs = ys.scaled(inputs64, scale)  # this point's own inputs (its cache style), scaled
    part = Check(act_max_logit=scale.max_logit, act_scale=scale.factor)
    verdict, diagnosis = OK, None
    state = {k: v.to(point.device, point.torch_dtype) for k, v in oracle_model.state_dict().items()}
    at = ys.at(point, oracle_model, inputs64, state, scale)
    try:  # the variant's call: what fails here is the variant's
        answer, check = compared_call(
            point, at, ys.sample, model, fn, inputs, state, checks.K_ACTIVATION
        )
        got = answer.tensors
    except (Exception, SystemExit) as e:
        status, said = classify(e), one_line(e)
        part = dataclasses.replace(part, act_check=f"{status}: {said}")
        if status not in ("unsupported", "oom"):  # it runs at unit scale and fails here
            verdict = Verdict(status, f"at activation scale: {said}")
    else:
        spoiled = [f"{t.name} ({t.ref_nonfinite})" for t in check.tensors if t.ref_nonfinite]
        note = (
            f" (nn.MHA itself non-finite, not compared there: {', '.join(spoiled)} elements)"
            if spoiled
            else ""
        )
        part = dataclasses.replace(
            part,
            act_check=("ok" if check.passed else "mismatch") + note,
            act_err_ratio=check.worst.err_ratio,
        )
        if not check.passed:
            w = named_first(check)
            said = check_status(check, []).error
            if w.problem.startswith("NaN/Inf"):
                said = f"non-finite {w.name} ({scale.describe()}; nn.MHA finite there): {said}"
            else:
                said = f"{scale.describe()}: {said}"
            diagnosis, why = diagnosed(point, oracle_model, inputs, got, check, at)
            verdict = Verdict("mismatch", f"at activation scale, {said}. {why}")
            part = part.merged(compared_part(check)).merged(Check(failed_scale="activation"))
    part = dataclasses.replace(part, act_check_s=time.perf_counter() - t0)
    return Stage(part, diagnosis, verdict)


def named_first(check: checks.CheckResult) -> checks.TensorCheck:
    """The tensor a failed check's error names: the first forward tensor over its tolerance (out,
    attn_weights, step2_out, in the oracle's order), else the worst (a gradient): a wrong output
    is said first, though a gradient it feeds may be further over its own tolerance."""
    forward = [t for t in check.tensors if not t.passed and "grad_" not in t.name]
    return forward[0] if forward else check.worst


def check_status(check: checks.CheckResult, problems: list) -> Verdict:
    """The verdict of a check (``Record.settle`` decides what it does to the outcome)."""
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


def build_and_check(
    admitted: capabilities.Admitted, record: Record, prior: dict | None, shelf: Shelf | None = None
):
    """Build the variant of an admitted point with nn.MHA's weights and check it (or keep the
    check of ``prior``, resume) against its shape's yardsticks (``shelf``'s: the last shape's
    kept; None: a shelf of its own). The record gets the check's parts, stage by stage, and their
    verdicts. Returns what its timing needs (``Checked``)."""
    point = admitted.point
    # before anything is allocated (an oom here says how much it needed)
    scores = materialises_scores(point, admitted.kernel)
    record.check = Check(mem_estimate_mb=check_fits(point, scores) / 2**20)
    oracle_model = make_reference(point)  # float64, CPU: the oracle and the weights' source
    inputs64 = make_inputs(point)
    variant = built(point, oracle_model, admitted.cls, record.identity.variant_distribution)
    model, fn = variant.model, variant.fn
    identity = record.identity = dataclasses.replace(
        record.identity, variant_distribution=variant.distribution, kv_cache=variant.kv_cache
    )
    kept = None if point.check_only else kept_check(prior, identity.variant_source_hash)
    if kept is not None:  # resume: the earlier run's check, probe and profile stand
        record.check, record.diagnosis = kept.check, kept.diagnosis
        record.probe, record.profile = kept.probe, kept.profile
        record.settle(OK)  # it was ok (``kept_check``)
        return Checked(model, fn, inputs64, kept, None)
    t0 = time.perf_counter()
    ys = (shelf or Shelf()).at(point)
    _, _, recheck, repeat, first = check_point(point, model, fn, oracle_model, inputs64, ys)

    def take(stage: Stage) -> None:
        record.check = record.check.merged(stage.check)
        record.diagnosis = stage.diagnosis or record.diagnosis
        record.settle(stage.verdict)

    take(first)
    if repeat:
        record.settle(Verdict("mismatch", repeat))
    # the checks at other scales ask more of a passing module: each runs while it passes
    later = [lambda: check_activation_scale(point, model, fn, oracle_model, inputs64, ys)]
    if point.torch_dtype in (torch.float16, torch.bfloat16):
        later.append(lambda: check_float32(point, oracle_model, inputs64, ys))
    for stage in later:
        if record.status != "ok":
            break
        take(stage())
    if record.status == "mismatch":  # weights rounded as they were loaded: the likely why
        why = rounded_note(model, point.torch_dtype)
        record.outcome = noted(record.outcome, why)
    failed_scale = record.check.failed_scale
    if (
        record.status == "mismatch" and failed_scale is None
    ):  # the point's own inputs (or float32's)
        failed_scale = "unit"
    record.check = dataclasses.replace(
        record.check, failed_scale=failed_scale, check_s=time.perf_counter() - t0
    )
    return Checked(model, fn, inputs64, None, recheck)
