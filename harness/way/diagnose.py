"""A mismatch explained: which known mistake the module computes, and where its error is
(docs/methodology.md, "Naming the mistake").

``name_mistakes``: every mistake of the catalogue (harness/way/mistakes.py) that applies to the
point is computed in float64 on the point's inputs, as the oracle is (``collect``, the same
tensors by the same names). A mistake that computes the right thing here (within the point's
tolerance of the oracle) is left out: it cannot explain a mismatch. The others are named when
*every* tensor the check compared lies within that tensor's tolerance of the mistake's: the
module is then as close to the mistake as a correct module is to nn.MHA. A near match (a few
times the tolerance) is not named: something else differs as well, and a name would send the
user to fix the wrong line. Where several fit, only those about as close as the closest are named
(``closest``).

``locate``: where the module's tensors differ from the oracle's, element by element beyond the
tensor's tolerance: which batch elements and query rows, which heads (the fewest whose blocks of
the merged heads, through nn.MHA's output projection, explain the output's error), which key
positions (from the attention weights, or the key and value gradients), and whether the
forward, the second decode step or only gradients are wrong.

Vocabulary: B batch, L query rows, S keys, E embed_dim, H heads, D head_dim.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from harness.way.checks import CheckResult, max_error
from harness.way.calls import STEP2, Inputs, in_float64, masked
from harness.way.compared import Rows
from harness.way.mistakes import CATALOGUE, DOCS, Math, Mistake
from harness.config import Point
from harness.schema_check import Diagnosis as DiagnosisPart

# The float64 scores one mistake holds (B x H x L x S, twice at a decode point): above this the
# catalogue is not run (256 MiB a mistake on the CPU). A mistake shows at a small shape as well
# as at a large one: the line says to re-check at a smaller seq_len.
MAX_SCORES = 2**25
FORWARD = ("out", "attn_weights")


@dataclass(frozen=True)
class Match:
    mistake: Mistake
    ratio: float  # the largest error against the mistake, in multiples of nn.MHA's own


@dataclass
class Diagnosis:
    matches: list[Match] = field(default_factory=list)
    tried: int = 0  # mistakes computed that show at this point
    skipped: str = ""  # why the catalogue did not run ("": it ran)

    @property
    def names(self) -> str:
        """The ``diagnosis`` column."""
        if self.skipped:
            return f"not run: {self.skipped}"
        return ";".join(m.mistake.name for m in self.matches) or "none"

    @property
    def says(self) -> str:
        """The ``diagnosis_says`` column: the sentence, short (no tolerances, no fixes)."""
        if not self.matches:
            return self.sentence().removeprefix("Diagnosis: ").removesuffix(".")
        said = ", or equally with ".join(m.mistake.says for m in self.matches)
        return f"it computes nn.MHA with {said}"

    @property
    def fixes(self) -> str:
        """The ``diagnosis_fix`` column."""
        return "; or ".join(m.mistake.fix for m in self.matches)

    def sentence(self) -> str:
        if self.skipped:
            return f"Diagnosis: not run ({self.skipped})."
        if not self.matches and not self.tried:
            return f"Diagnosis: no known mistake shows at this point ({DOCS})."
        if not self.matches:
            return (
                f"Diagnosis: none of the {self.tried} known mistakes that show at this point "
                f"matches ({DOCS})."
            )
        said = ", or equally with ".join(
            # the distance to the mistake, not to nn.MHA: "within 1.1x nn.MHA's own error" alone
            # read like a pass (issue 74)
            f"{m.mistake.says} (its distance from that mistake: {m.ratio:.2g}x nn.MHA's own "
            f"error; fix: {m.mistake.fix})"
            for m in self.matches
        )
        return f"Diagnosis: it computes nn.MHA with {said} ({DOCS})."


@dataclass(frozen=True)
class Failed:
    """A failed check: everything its diagnosis reads."""

    point: Point
    reference: nn.MultiheadAttention  # the float64 oracle's module: nn.MHA's weights
    inputs64: Inputs  # the inputs the failing check ran on (float64, CPU)
    # the module's tensors, as the check compared them (``grouped``; where the check samples
    # query rows, the sampled rows of the forward tensors: harness/way/compared.py)
    got: dict
    check: CheckResult
    oracle: dict  # the float64 oracle's tensors
    sample: Rows | None  # the query rows compared (None: every row)


def _scores(point: Point) -> int:
    steps = 2 if point.kv_cache_len is not None else 1
    return point.batch * point.num_heads * point.seq_len * point.kv_seq_len * steps


def _within(a: dict, b: dict, check: CheckResult, skips: dict) -> float | None:
    """The largest error of ``a`` against ``b`` in multiples of nn.MHA's own, over every tensor
    the check compared; None if any tensor is beyond its tolerance (or missing), or if ``b``'s
    forward has no finite element to compare."""
    worst, compared = 0.0, False
    for t in check.tensors:
        if t.name not in a or t.name not in b:
            return None
        err = max_error(a[t.name], b[t.name], skips.get(t.name))[0]
        # a mistake larger than the right tensor (a softmax over the queries sums the values of
        # hundreds of keys) rounds in proportion: its tolerance grows with it, never shrinks
        finite = b[t.name][torch.isfinite(b[t.name])]
        larger = finite.abs().max().item() / t.scale if finite.numel() and t.scale > 0 else 1.0
        if not err <= t.tolerance * max(1.0, larger):
            return None
        worst = max(worst, err / t.ref_err if t.ref_err > 0 else 0.0)
        if _forward(t.name):
            compared = compared or bool(torch.isfinite(b[t.name]).any())
    # NaN everywhere matches NaN everywhere whatever made it: no evidence for one cause (and
    # some gradients are the same for every module: grad_out_proj.bias sums grad_out)
    return worst if compared else None


def name_mistakes(failed: Failed) -> Diagnosis:
    """The catalogue's mistakes that the module's tensors compute."""
    point, reference, inputs64 = failed.point, failed.reference, failed.inputs64
    got, check, oracle = failed.got, failed.check, failed.oracle
    if _scores(point) > MAX_SCORES:
        return Diagnosis(
            skipped=f"{_scores(point):.3g} float64 scores a mistake > {MAX_SCORES:.3g}; "
            "check_only=true at a smaller seq_len names it"
        )
    state = reference.state_dict()
    skips = {t.name: t.skip for t in check.tensors}  # what the check left out
    forward = CheckResult(tuple(t for t in check.tensors if _forward(t.name)))
    found = Diagnosis()
    # Each mistake runs as the module did, on every query row (a head merge without the permute
    # mixes rows), and is compared on the rows the check compared, its gradients after the same
    # grad_out (zero outside a sample: harness/way/compared.py)
    inputs64 = masked(point, failed.sample, inputs64)
    for entry in CATALOGUE:
        if not entry.applies(point):
            continue
        tried = False
        for safe in (False, True):  # a row it hides whole: NaN (manual) or zero weights (SDPA)
            model = Math(reference, point, entry, safe)
            # the forward first: it tells most mistakes apart, at a third of a backward's cost
            wrong = in_float64(point, failed.sample, model, inputs64, "fwd", state)
            right_forward = _within(wrong, oracle, forward, skips) is not None
            if point.mode == "fwd_bwd" and (right_forward or _within(got, wrong, forward, skips)):
                wrong = in_float64(point, failed.sample, model, inputs64, point.mode, state)
                if _within(wrong, oracle, check, skips) is not None:
                    break  # the right thing here: it cannot explain a mismatch
            elif right_forward:
                break
            tried = True
            ratio = _within(got, wrong, check, skips)
            if ratio is not None:
                found.matches.append(Match(entry, ratio))
                break
            if not _hides_a_row(wrong):
                break  # its safe twin computes the same: nothing more to try
        found.tried += tried
    found.matches = closest(found.matches)
    return found


# A second mistake is named beside the closest only when it fits about as well: within twice the
# closest one's error, or within nn.MHA's own error. Both fitting the tolerance is not enough in
# half precision, whose tolerance is a few times nn.MHA's own error: ALiBi omitted and ALiBi
# scaled by 1/sqrt(D) both fit a module that omits it in bfloat16, at 0.56x and 4.0x.
AS_WELL = 2.0


def closest(matches: list[Match]) -> list[Match]:
    """``matches`` less those that fit clearly worse than the closest one."""
    if not matches:
        return matches
    best = min(m.ratio for m in matches)
    return [m for m in matches if m.ratio <= max(AS_WELL * best, 1.0)]


def _hides_a_row(tensors: dict) -> bool:
    """Whether a mistake's forward output has non-finite values (a row whose keys it all hid)."""
    out = tensors.get("out")
    return out is not None and not bool(torch.isfinite(out).all())


def _forward(name: str) -> bool:
    return name.removeprefix(STEP2) in FORWARD


# -------------------------------------------------------------------------------- localisation


def spans(index: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    out, start = [], None
    for i, j in zip(index, [*index[1:], None]):
        start = i if start is None else start
        if j != i + 1:
            out.append(str(start) if start == i else f"{start}-{i}")
            start = None
    return ", ".join(out)


def which(noun: str, index: list[int], n: int) -> str:
    """ "query rows 5-7 of 8", "all 8 query rows", "query row 3 of 8"."""
    if len(index) == n:
        return f"all {n} {noun}s" if n > 1 else f"the one {noun}"
    return f"{noun}{'s' if len(index) > 1 else ''} {spans(index)} of {n}"


def differs(actual, oracle, tolerance: float, skip=None) -> torch.Tensor:
    """Bool, the oracle's shape: the elements beyond ``tolerance`` (non-finite where the oracle
    is finite counts; where both are non-finite it does not)."""
    a, o = actual.detach().double().cpu(), oracle.detach().double().cpu()
    finite = torch.isfinite(o)
    bad = (torch.isfinite(a) != finite) | (finite & ((a - o).abs() > tolerance))
    return bad & ~skip if skip is not None else bad


def sampled_rows(index: list[int], compared: int, L: int) -> str:
    """ "query rows 0-1, 5 (3 of the 4 rows compared of 6; the others were not compared)", the
    rows among a sample (harness/way/compared.py); past six spans the first three and last two."""
    if len(index) == compared:
        return f"all {compared} query rows compared of {L} (the others were not compared)"
    said = spans(index).split(", ")
    if len(said) > 6:
        said = [*said[:3], "...", *said[-2:]]
    return (
        f"query row{'s' if len(index) > 1 else ''} {', '.join(said)} ({len(index)} of the "
        f"{compared} rows compared of {L}; the others were not compared)"
    )


def _indices(bad: torch.Tensor, dim: int) -> list[int]:
    others = [d for d in range(bad.dim()) if d != dim % bad.dim()]
    return bad.any(dim=others).nonzero().flatten().tolist() if others else []


@dataclass
class Where:
    """Where a mismatching module's tensors differ from the oracle's (the ``wrong_*`` columns)."""

    wrong_in: str = ""  # forward | second_step | gradients
    tensors: list[str] = field(default_factory=list)  # the failing tensors, forward first
    heads: list[int] | None = None
    rows: list[int] | None = None
    batch: list[int] | None = None
    keys: list[int] | None = None
    keys_from: str = ""
    params: list[str] = field(default_factory=list)  # "grad_in_proj_weight: K rows of heads 0-3"
    nonfinite: bool = False  # NaN/Inf where the oracle is finite
    problem: str = ""  # a tensor of the wrong shape or missing
    sizes: dict = field(default_factory=dict)  # B, L, S, H
    # where the check compared a sample of the query rows (harness/way/compared.py): how many;
    # the rows named are among them, the others were not compared (the localisation is partial)
    compared: int | None = None

    def columns(self) -> dict:
        def joined(index):
            return None if index is None else spans(index)

        return dict(
            wrong_in=self.wrong_in,
            wrong_heads=joined(self.heads),
            wrong_rows=joined(self.rows),
            wrong_batch=joined(self.batch),
            wrong_keys=joined(self.keys),
            wrong_where=self.sentence(),
        )

    def sentence(self) -> str:
        n = self.sizes
        if self.problem:
            return f"Where: {self.problem}."
        parts = []
        if self.heads is not None:
            parts.append(which("head", self.heads, n["H"]))
        if self.rows is not None and self.compared is not None:
            parts.append(sampled_rows(self.rows, self.compared, n["L"]))
        elif self.rows is not None:
            parts.append(which("query row", self.rows, n["L"]))
        if self.batch is not None:
            parts.append(which("batch element", self.batch, n["B"]))
        if self.keys is not None:
            parts.append(which("key position", self.keys, n["S"]) + f" ({self.keys_from})")
        at = ", ".join(parts)
        bad = " (NaN/Inf where nn.MHA's math is finite)" if self.nonfinite else ""
        if self.wrong_in == "gradients":
            return f"Where: the forward matches; only gradients differ: {'; '.join(self.params)}."
        if self.wrong_in == "second_step":
            return (
                "Where: the first decode step matches; the second, on the cache the first wrote, "
                f"differs{bad} in {at}."
            )
        return f"Where: the output differs{bad} in {at}."


def _heads(point: Point, error: torch.Tensor, tolerance: float, reference) -> list[int]:
    """The fewest heads whose blocks of the merged output explain the output's error.

    out = x @ Wo.T + bo, so an error in head h's block of x (B, L, D of the merged heads) is an
    error in the span of Wo's columns for head h. Inverting Wo to read the blocks off would
    amplify the rounding error by Wo's condition number (about 1400 for nn.MHA's random weights
    at E=16: bfloat16 rounding then looks like a wrong head). Instead the heads are chosen
    greedily (group orthogonal matching pursuit): the head whose columns take the most of the
    error away, then the next, until what is left is within the output's tolerance.
    ``error``: (rows, E), module minus oracle, finite rows only."""
    W = reference.out_proj.weight.detach().double()  # (E, E)
    H = point.num_heads
    D = W.size(0) // H
    chosen: list[int] = []
    basis = W.new_zeros(W.size(0), 0)  # orthonormal, the chosen heads' columns
    left = error
    while left.abs().max().item() > tolerance and len(chosen) < H:
        best = None
        for h in (h for h in range(H) if h not in chosen):
            cols = W[:, h * D : (h + 1) * D]
            q = torch.linalg.qr(cols - basis @ (basis.T @ cols)).Q  # (E, D)
            gain = (left @ q).pow(2).sum().item()
            if best is None or gain > best[0]:
                best = (gain, h, q)
        _, h, q = best
        chosen.append(h)
        basis = torch.cat([basis, q], dim=1)
        left = left - (left @ q) @ q.T
    return sorted(chosen)


# Rows of the output's error the heads are located on: the worst ones (B x L can be 16k rows).
HEAD_ROWS = 256


def _param_rows(point: Point, name: str, bad: torch.Tensor) -> str:
    """Which blocks of a parameter's gradient differ: in_proj's Q/K/V rows by head, out_proj's
    input columns by head."""
    E, H = point.embed_dim, point.num_heads
    D = E // H
    if name in ("grad_in_proj_weight", "grad_in_proj_bias") and bad.size(0) == 3 * E:
        rows = bad.reshape(3, H, D, -1).any(dim=(2, 3))  # (3, H)
        said = [
            f"{part} rows of {which('head', rows[i].nonzero().flatten().tolist(), H)}"
            for i, part in enumerate("QKV")
            if rows[i].any()
        ]
        return f"{name} ({'; '.join(said)})"
    if name == "grad_out_proj.weight" and bad.dim() == 2:
        cols = bad.reshape(E, H, D).any(dim=(0, 2)).nonzero().flatten().tolist()
        return f"{name} (the columns of {which('head', cols, H)})"
    if name in ("grad_query", "grad_key", "grad_value") and bad.dim() == 3:
        role = {"grad_query": "query" if point.cross else "token", "grad_key": "key"}
        noun = f"{role.get(name, 'value')} position"
        return f"{name} ({which(noun, _indices(bad, 1), bad.size(1))})"
    return name


def _keys(actual, oracle, bad: torch.Tensor, name: str) -> tuple[list[int], str]:
    """The key positions (last dim of attention weights, dim 1 of a key gradient) to name: those
    a mask decides, where one of the two is exactly zero and the other is not (a key seen where
    nn.MHA hides it, or the reverse), when there are any; else every key that differs (a
    softmax's normalisation moves every weight of a row whose scores change anywhere)."""
    a, o = actual.detach().double().cpu(), oracle.detach().double().cpu()
    if name.endswith("attn_weights"):
        flips = bad & ((a == 0) != (o == 0))
        dim = -1
    else:  # (B, S, E): a key nobody may see has a zero gradient
        flips = (bad & ((a == 0).all(-1, keepdim=True) != (o == 0).all(-1, keepdim=True))).any(-1)
        dim = 1
    if flips.any():
        return _indices(flips, dim), f"{name}: seen or hidden against nn.MHA's masks"
    return _indices(bad, dim), name


def locate(failed: Failed) -> Where:
    """Where the failing tensors of the check differ from the oracle (``Where``)."""
    point, reference, got = failed.point, failed.reference, failed.got
    check, oracle = failed.check, failed.oracle
    failing = [t for t in check.tensors if not t.passed]
    sample = failed.sample
    where = Where(
        tensors=[t.name for t in failing],
        sizes=dict(B=point.batch, L=point.seq_len, S=point.kv_seq_len, H=point.num_heads),
        compared=None if sample is None else sample.count,
    )

    def rows_of(index: list[int]) -> list[int]:  # the sequence's rows of the compared ones
        return index if sample is None else [sample.row(i) for i in index]

    shaped = next((t for t in failing if t.problem and not t.problem.startswith("NaN")), None)
    if shaped is not None:
        where.problem = f"{shaped.name} {shaped.problem}"
        return where
    tolerance = {t.name: t.tolerance for t in check.tensors}
    bad = {t.name: differs(got[t.name], oracle[t.name], t.tolerance, t.skip) for t in failing}
    forward = [n for n in where.tensors if n in FORWARD]
    second = [n for n in where.tensors if n.startswith(STEP2)]
    if forward or second:
        where.wrong_in = "forward" if forward else "second_step"
        prefix = "" if forward else STEP2
        out = prefix + "out"
        if out in bad:
            b = bad[out]  # (B, L, E)
            where.rows, where.batch = rows_of(_indices(b, 1)), _indices(b, 0)
            a, o = got[out].detach().double().cpu(), oracle[out].double()
            nonfinite = (~torch.isfinite(a) & torch.isfinite(o)).any(dim=-1)  # (B, L)
            where.nonfinite = bool(nonfinite.any())
            rows_ok = ~nonfinite & torch.isfinite(o).all(dim=-1)  # (B, L)
            error = (a - o)[rows_ok]  # (rows, E)
            if len(error):
                worst = error.abs().amax(dim=-1).topk(min(HEAD_ROWS, len(error))).indices
                heads = _heads(point, error[worst], tolerance[out], reference)
                where.heads = heads or None
        weights = prefix + "attn_weights"
        if weights in bad:  # (B, L, S) or (B, H, L, S)
            w = bad[weights]
            where.keys, where.keys_from = _keys(got[weights], oracle[weights], w, weights)
            if where.rows is None:
                where.rows, where.batch = rows_of(_indices(w, -2)), _indices(w, 0)
            if w.dim() == 4 and where.heads is None:
                where.heads = _indices(w, 1)
        for name in ("grad_key", "grad_value"):  # cross-attention: the keys' own gradients
            if where.keys is None and name in bad:
                where.keys, where.keys_from = _keys(got[name], oracle[name], bad[name], name)
        if second and not forward:  # the second step's keys: P + 2L
            where.sizes["S"] = point.kv_seq_len + point.seq_len
    else:
        where.wrong_in = "gradients"
        where.params = [_param_rows(point, n, bad[n]) for n in where.tensors]
    return where


def explain(failed: Failed) -> tuple[DiagnosisPart, str]:
    """On a mismatch: the record's diagnosis part, and its sentence for the row's error."""
    t0 = time.perf_counter()
    found = name_mistakes(failed)
    where = locate(failed)
    part = DiagnosisPart(
        diagnosis=found.names,
        diagnosis_tried=found.tried,
        diagnosis_says=found.says,
        diagnosis_fix=found.fixes,
        **where.columns(),
        diagnose_s=time.perf_counter() - t0,
    )
    return part, f"{found.sentence()} {where.sentence()}"
