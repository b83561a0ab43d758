"""The activation-scale check (harness/way/scale.py, docs/methodology.md "Two scales"): a
numerics mistake invisible at unit scale is a mismatch that names the scale; the inputs reach
the stated logit; nn.MHA's own overflow is never blamed on the variant."""

import itertools
import math
import sys

import pytest
import torch

from harness.api import verify
from harness.way import checks
from harness.way.scale import channels, find_scale
from harness.way.yardsticks import scaled
from harness.config import InvalidPoint
from harness.factory import make_point
from harness.way.inputs import make_inputs, make_reference
from tests.conftest import REPO

sys.path.insert(0, str(REPO / "tests" / "negative"))  # the gallery's modules

SHAPE = dict(batch=2, seq_len=6, embed_dim=16, num_heads=4, device="cpu", num_threads=1)
DTYPES = ("float32", "bfloat16", "float16")
CASES = list(itertools.product(DTYPES, ("none", "causal"), ("fwd", "fwd_bwd")))


@pytest.mark.parametrize("mistake", ["mistakes.UnstableSoftmax", "mistakes.GlobalMaxSoftmax"])
def test_a_softmax_that_overflows_is_a_mismatch_at_activation_scale_only(mistake):
    missed, hidden = [], []
    for dtype, mask, mode in CASES:
        row = verify(mistake, dtype=dtype, mask=mask, mode=mode, **SHAPE)
        flagged = (
            row["status"] == "mismatch"
            and row["failed_scale"] == "activation"
            and row["act_check"] == "mismatch"
            and row["error"].startswith("at activation scale, ")
            and "largest logit 10" in row["error"]  # the scale it failed at: about 100
        )
        if not flagged:
            missed.append(f"{dtype} {mask} {mode}: {row['status']} {row.get('error')}")
        # the same module with the pass turned off: the unit-scale check alone passes it
        off = verify(mistake, dtype=dtype, mask=mask, mode=mode, check_max_logit=None, **SHAPE)
        if off["status"] != "ok" or off["act_check"] != "off":
            hidden.append(f"{dtype} {mask} {mode}: {off['status']} {off.get('error')}")
    assert not missed, "not flagged at activation scale: " + "; ".join(missed)
    assert not hidden, "flagged at unit scale: " + "; ".join(hidden)


def test_an_overflow_says_non_finite_and_that_nn_mha_is_finite_there():
    row = verify("mistakes.UnstableSoftmax", dtype="float32", **SHAPE)
    assert row["error"].startswith("at activation scale, non-finite out (largest logit "), row
    assert "nn.MHA finite there" in row["error"] and "NaN/Inf in " in row["error"]
    assert row["worst_tensor"] == "out" and row["check_passed"] is False


def test_the_stable_twin_and_nn_mha_pass_at_both_scales():
    failed = []
    for name in ("mistakes.StableSoftmax", "reference"):
        for dtype, mask, mode in CASES:
            row = verify(name, dtype=dtype, mask=mask, mode=mode, **SHAPE)
            if row["status"] != "ok" or row["act_check"] != "ok":
                failed.append(f"{name} {dtype} {mask} {mode}: {row['status']} {row['error']}")
    assert not failed, "\n".join(failed)


def visible_max_logit(point, inputs) -> float:
    """nn.MHA's largest logit a softmax sees, computed here from its weights directly: every
    query row, the point's mask applied."""
    mha = make_reference(point)
    E, H = point.embed_dim, point.num_heads
    D = E // H
    w, b = mha.in_proj_weight.detach(), mha.in_proj_bias.detach()
    q = (inputs.query @ w[:E].T + b[:E]).view(point.batch, -1, H, D).transpose(1, 2)
    k = (inputs.key @ w[E : 2 * E].T + b[E : 2 * E]).view(point.batch, -1, H, D).transpose(1, 2)
    logits = q @ k.transpose(-2, -1) / math.sqrt(D)
    mask = inputs.kwargs.get("attn_mask")
    if mask is not None:
        logits = logits.masked_fill(mask, float("-inf"))
    return logits.max().item()


@pytest.mark.parametrize("target", [100.0, 300.0])
@pytest.mark.parametrize("mask", ["none", "causal"])
def test_the_inputs_reach_the_stated_logit_in_a_few_channels_only(target, mask):
    point = make_point("fused", mask=mask, check_max_logit=target, **SHAPE)
    inputs = make_inputs(point)
    scale = find_scale(make_reference(point), inputs, target, point.seed)
    big = scaled(inputs, scale.channels, scale.factor)
    reached = visible_max_logit(point, big)
    assert reached == pytest.approx(target, rel=0.02) and reached == pytest.approx(scale.max_logit)
    assert visible_max_logit(point, inputs) < 10  # the point's own inputs: unit scale
    # only the outlier channels changed, by the factor; self-attention stays one tensor
    changed = (big.query != inputs.query).any(dim=(0, 1)).nonzero().flatten().tolist()
    assert tuple(changed) == scale.channels == channels(point.embed_dim, point.seed)
    assert torch.allclose(big.query[..., changed], inputs.query[..., changed] * scale.factor)
    assert big.key is big.query and big.value is big.query
    assert big.grad_out is inputs.grad_out and big.kwargs is inputs.kwargs


def test_a_decode_points_prefix_and_next_step_are_scaled_too():
    decode = {**SHAPE, "kv_cache_len": 8, "seq_len": 2}
    point = make_point("fused", **decode)
    inputs = make_inputs(point)
    big = scaled(inputs, (3,), 10.0)
    for a, b in ((big.prefix, inputs.prefix), (big.then.query, inputs.then.query)):
        assert torch.equal(a[..., 3], b[..., 3] * 10) and torch.equal(a[..., :3], b[..., :3])
    row = verify("fused", variant={"attention": "sdpa"}, **decode)
    assert row["status"] == "ok" and row["act_check"] == "ok", row
    assert row["act_max_logit"] == pytest.approx(100, rel=0.02)


def test_nn_mha_non_finite_elements_are_left_out_not_blamed():
    oracle = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    reference = torch.tensor([1.0, float("inf"), 3.0, 4.0])
    right = torch.tensor([1.0, 2.0, 3.0, 4.0])
    overflowed_too = torch.tensor([1.0, float("nan"), 3.0, 4.0])
    nan_elsewhere = torch.tensor([1.0, 2.0, float("nan"), 4.0])
    for actual in (right, overflowed_too):
        t = checks.check_tensor("out", actual, reference, oracle, "float32")
        assert t.passed and t.ref_nonfinite == 1 and math.isfinite(t.tolerance)
    t = checks.check_tensor("out", nan_elsewhere, reference, oracle, "float32")
    assert not t.passed and t.problem.startswith("NaN/Inf in 1 elements")


@pytest.mark.parametrize("bad", [0, -5, "big"])
def test_a_bad_check_max_logit_is_refused_in_one_line(bad):
    with pytest.raises(InvalidPoint, match=r"check_max_logit=.* must be a positive number"):
        make_point("fused", check_max_logit=bad, **SHAPE)


def test_where_no_logit_can_grow_positive_the_largest_in_magnitude_is_reached():
    """One key and one head of one channel: the only logit is w_q w_k x^2, negative for some
    seeds whatever the factor (found by hypothesis in tests/test_robustness.py)."""
    point = make_point(
        "fused",
        **{
            **SHAPE,
            "batch": 1,
            "seq_len": 1,
            "embed_dim": 1,
            "num_heads": 1,
            "bias": False,
            "seed": 0,
        },
    )
    scale = find_scale(make_reference(point), make_inputs(point), 100.0, point.seed)
    assert not scale.signed and scale.max_logit == pytest.approx(100, rel=0.02)
    assert "largest |logit| 100" in scale.describe()
    row = verify(
        "fused",
        **{**SHAPE, "batch": 1, "seq_len": 1, "embed_dim": 1, "num_heads": 1, "bias": False},
    )
    assert row["status"] == "ok" and row["act_check"] == "ok", row
