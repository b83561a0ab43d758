"""Does the variant compute what nn.MultiheadAttention computes? Numbers first, verdict second.

Both the variant and nn.MultiheadAttention run in the point's dtype and are compared with a
float64 nn.MultiheadAttention (the oracle) on the same weights and inputs, tensor by tensor
(output, attention weights, gradients; see ``harness.way.calls``). A tensor passes when

    max |variant - oracle|  <=  max(ATOL[dtype] * max(1, max |oracle|),  K * ref_err)

where ref_err is max |nn.MHA in dtype - oracle|: a variant may be at most K times less exact
than PyTorch's own implementation in that dtype (the rule of flash-attention's tests), with a
floor of a few units in the last place at the tensor's magnitude for tensors the reference
happens to get (nearly) exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from harness.way.calls import STEP2
from harness.way.compared import Rows

# K: a correct variant orders its arithmetic differently from nn.MHA (SDPA vs matmul+softmax,
# fused vs split projections, compiled kernels); measured here its error is 0.9x to 1.1x
# nn.MHA's own, so 4x leaves room for other shapes and backends. The mistakes the checker
# must catch (wrong scale, unpermuted heads, dropped bias, unapplied mask) are 10x to 1000x.
K = 4.0
# K at activation scale (harness/way/scale.py): logits of about 100 carry rounding errors of
# eps x 100 (0.4 in bfloat16), which swing nearly tied softmax weights, so two correct
# implementations' largest errors differ more than at unit scale: measured up to 3.4x nn.MHA's
# own in float16 and bfloat16 (manual, SDPA; 8 seeds), 4.7x for FlexAttention's bfloat16 decode,
# 1.3x in float32 (docs/measurements.md). The mistakes that pass (an overflowing softmax)
# are NaN/Inf or errors of 100x and more.
K_ACTIVATION = 16.0
# Floors relative to the tensor's magnitude: float32 eps is 1.2e-7, float16 9.8e-4, bfloat16
# 7.8e-3; the floors are about 80, 4 and 4 eps, below any mistake's signature.
ATOL = {"float32": 1e-5, "float16": 4e-3, "bfloat16": 3e-2}


@dataclass(frozen=True)
class TensorCheck:
    name: str  # out, attn_weights, grad_query, grad_in_proj_weight, ...
    max_abs_err: (
        float  # max |variant - oracle| (inf: NaN/Inf where the oracle is finite, or wrong shape)
    )
    ref_err: float  # max |nn.MHA in dtype - oracle|
    tolerance: float
    scale: float  # max |oracle|
    worst_index: tuple  # index of the largest error
    problem: str = ""  # why the error is infinite: "NaN/Inf ...", "shape ...", "missing"
    # elements where nn.MHA itself is NaN/Inf and the oracle is not (nn.MHA overflowing at
    # activation scale): not compared, neither nn.MHA's error nor the variant's
    ref_nonfinite: int = 0
    # those elements (bool, the oracle's shape; None: none): what a diagnosis leaves out too
    skip: torch.Tensor | None = field(default=None, repr=False, compare=False)

    @property
    def passed(self) -> bool:
        return self.max_abs_err <= self.tolerance

    @property
    def max_rel_err(self) -> float:  # normwise: elementwise ratios blow up near zero
        return self.max_abs_err / self.scale if self.scale > 0 else self.max_abs_err

    @property
    def err_ratio(self) -> float:  # how many times nn.MHA's own error
        if self.ref_err > 0:
            return self.max_abs_err / self.ref_err
        return 0.0 if self.max_abs_err == 0 else float("inf")


@dataclass(frozen=True)
class CheckResult:
    tensors: tuple[TensorCheck, ...]

    @property
    def passed(self) -> bool:
        return all(t.passed for t in self.tensors)

    @property
    def worst(self) -> TensorCheck:
        """The tensor furthest over (or closest to) its tolerance."""
        return max(
            self.tensors,
            key=lambda t: t.max_abs_err / t.tolerance if t.tolerance > 0 else float("inf"),
        )


def max_error(
    actual: torch.Tensor, oracle: torch.Tensor, skip: torch.Tensor | None = None
) -> tuple[float, tuple, str]:
    """Max abs error, where, and why it is infinite if it is. Non-finite values must sit where
    the oracle's are (a fully masked row is NaN in nn.MHA too); anywhere else they are an
    infinite error. ``skip`` (bool, the oracle's shape): elements not compared."""
    if actual.shape != oracle.shape:
        what = "missing" if actual.numel() == 0 else f"shape {tuple(actual.shape)}"
        return float("inf"), (), f"{what}, expected {tuple(oracle.shape)}"
    if actual.numel() == 0:
        return 0.0, (), ""
    if actual.is_meta:  # the right shape on a device that holds no numbers
        return float("inf"), (), "on the meta device: no values to compare"
    a, o = actual.detach().double().cpu(), oracle.detach().double().cpu()
    finite = torch.isfinite(o)
    if skip is not None:  # compared as if both were the oracle's there
        a = torch.where(skip, o, a)
    bad = torch.isfinite(a) != finite
    if bad.any():
        n = int(bad.sum())
        return (
            float("inf"),
            tuple(int(i) for i in bad.nonzero()[0]),
            f"NaN/Inf in {n} elements where the oracle is finite",
        )
    diff = torch.where(finite, (a - o).abs(), torch.zeros_like(a))
    flat = int(diff.argmax())
    return (
        diff.reshape(-1)[flat].item(),
        unravel(flat, diff.shape),
        "",
    )


def unravel(flat: int, shape) -> tuple:
    """The index of element ``flat`` of a tensor of ``shape``, in plain Python: torch.unravel_index
    imports torch's symbolic-shape machinery (sympy: 0.4-0.6 s of every worker's first check)."""
    out = []
    for n in reversed(tuple(shape)):
        flat, i = divmod(flat, n)
        out.append(i)
    return tuple(reversed(out))


def spoiled_by(reference: torch.Tensor, oracle: torch.Tensor) -> torch.Tensor | None:
    """The elements a check leaves out (bool, the oracle's shape; None: none): where nn.MHA
    itself is NaN/Inf and the oracle is not, nothing is learnt about the variant and nn.MHA has
    no error to scale a tolerance by (they are counted instead)."""
    if reference.shape != oracle.shape or not reference.numel():
        return None
    o = oracle.detach().cpu()
    spoiled = torch.isfinite(o) & ~torch.isfinite(reference.detach().cpu())
    return spoiled if spoiled.any() else None


def check_tensor(
    name: str,
    actual: torch.Tensor,
    reference: torch.Tensor,
    oracle: torch.Tensor,
    dtype: str,
    k: float = K,
) -> TensorCheck:
    spoiled = spoiled_by(reference, oracle)
    err, index, problem = max_error(actual, oracle, spoiled)
    ref_err = max_error(reference, oracle, spoiled)[0]
    finite = oracle[torch.isfinite(oracle)]
    scale = finite.abs().max().item() if finite.numel() else 0.0
    return TensorCheck(
        name,
        err,
        ref_err,
        max(ATOL[dtype] * max(1.0, scale), k * ref_err),
        scale,
        index,
        problem,
        0 if spoiled is None else int(spoiled.sum()),
        spoiled,
    )


def compare(actual: dict, reference: dict, oracle: dict, dtype: str, k: float = K) -> CheckResult:
    """Check every tensor the oracle has; one the variant lacks is an infinite error."""
    missing = torch.empty(0)
    return CheckResult(
        tuple(
            check_tensor(name, actual.get(name, missing), reference[name], oracle[name], dtype, k)
            for name in oracle
        )
    )


def drop_in(actual: dict, reference: dict, changed: list[str]) -> list[str]:
    """What keeps a variant from replacing nn.MultiheadAttention whatever its numbers: outputs in
    another dtype or on another device (the value check compares in float64 on the CPU, so it
    cannot see them), and inputs or masks changed in place. One reason per problem."""
    problems = []
    for name in ("out", "attn_weights"):
        got, ref = actual.get(name), reference.get(name)
        if got is None or ref is None or got.numel() == 0:
            continue
        if got.dtype != ref.dtype:
            problems.append(
                f"{name} dtype {str(got.dtype).removeprefix('torch.')}, "
                f"expected {str(ref.dtype).removeprefix('torch.')}"
            )
        if got.device != ref.device:
            problems.append(f"{name} device {got.device}, expected {ref.device}")
    problems += [f"{name} modified in place" for name in changed]
    return problems


@dataclass(frozen=True)
class At:
    """The yardsticks at one dtype and scale (``Yardsticks.at``): the float64 oracle's tensors
    and nn.MHA's in that dtype, as the check compares them (grouped, the sampled rows)."""

    oracle: dict
    ref: dict
    sample: Rows | None

    def compare(self, got: dict, dtype: str, k=K) -> CheckResult:
        """``compare`` of a module's tensors (``called``'s) with these, each worst index in
        the whole sequence's rows."""
        result = compare(got, self.ref, self.oracle, dtype, k)
        if self.sample is None:
            return result
        return CheckResult(
            tuple(
                replace(t, worst_index=self.sample.in_sequence(t.name, t.worst_index))
                for t in result.tensors
            )
        )

    def first_step(self) -> At:
        """These without a decode point's second step (``STEP2``)."""

        def first(tensors: dict) -> dict:
            return {k: v for k, v in tensors.items() if not k.startswith(STEP2)}

        return At(first(self.oracle), first(self.ref), self.sample)
