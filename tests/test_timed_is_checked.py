"""What was timed is what was checked (docs/methodology.md): a re-check after the
rounds, a rewind outside the timing, decode checked over two steps on a cache with room to
spare, the float32 structure check of half-precision points, and left-padded batched decode.

Each planted mistake is in tests/negative/mistakes.py, next to its correct twin."""

import sys

import pytest
import torch

from harness import time_it, verify
from harness.way.recheck import Counted, Recheck
from harness.config import InvalidPoint
from harness.progress import result_line
from tests.conftest import REPO

sys.path.insert(0, str(REPO / "tests" / "negative"))  # the gallery's modules

# E=32, 8 heads, 2 K/V heads, P=8, one new token: the case the issue tried
DECODE = dict(embed_dim=32, num_heads=8, num_kv_heads=2, kv_cache_len=8, seq_len=1, batch=2)
QUICK = {"rounds": 3, "round_time": 0.005, "warmup": 0.005}


def test_a_committing_cache_without_a_rewind_is_a_mismatch_that_names_the_changed_output():
    row = time_it("mistakes.CacheKept", **DECODE, timing=QUICK)
    assert row["check_passed"] is True  # its first call is right: the check alone passed it
    assert row["status"] == "mismatch"
    assert "the output changed after" in row["error"] and "timed calls" in row["error"]
    assert "max difference" in row["error"] and "rewind" in row["error"]


def test_with_a_rewind_the_same_cache_is_ok_and_its_timed_calls_give_the_checked_output():
    row = time_it("mistakes.CacheRewound", **DECODE, timing=QUICK)
    assert row["status"] == "ok", row["error"]
    assert row["latency_ms_median"] > 0


def test_the_rewind_runs_before_every_timed_call_outside_the_timing():
    """timed_call's ``before`` is the rewind: each call then sees the prefix alone."""
    from harness.way.build import build_variant
    from harness.way.capabilities import variant_class
    from harness.api import make_point
    from harness.way.inputs import make_inputs, make_reference
    from harness.way.recheck import timed_call

    point = make_point("mistakes.CacheRewound", **DECODE)
    model = build_variant(point, make_reference(point), variant_class(point.variant))
    call, before = timed_call(model, model, make_inputs(point).to("cpu", torch.float32), "fwd")
    assert before is not None
    outs = []
    for _ in range(3):
        before()
        outs.append(call()[0])
    assert all(torch.equal(outs[0], o) for o in outs[1:])


@pytest.mark.parametrize(
    "mistake", ["mistakes.CacheWholeBuffer", "mistakes.CacheEarly", "mistakes.CacheKept"]
)
def test_cache_mistakes_that_one_fresh_step_hid_are_mismatches(mistake):
    """A cache that returns its whole buffer shows once the cache has room beyond P + L; one
    whose commit counts a token short shows at the second step, which reads the first step's
    writes back; a cache that keeps every call's keys, right over two steps, shows at the
    repeated call (tests/test_gate_catches_state.py) and at the re-check (time_it above)."""
    row = verify(mistake, **DECODE)
    if mistake == "mistakes.CacheKept":
        assert row["check_passed"] is True and row["status"] == "mismatch", row
        assert "when the checked call was repeated" in row["error"]
        return
    assert row["status"] == "mismatch", row
    if mistake == "mistakes.CacheEarly":
        assert row["worst_tensor"] == "step2_out"  # the first step is right


@pytest.mark.parametrize("style", ["static", "concat"])
@pytest.mark.parametrize("variant", ["separate", "fused", "packed", "reference"])
def test_correct_caches_pass_both_steps(variant, style):
    row = verify(variant, **DECODE, kv_cache=style)
    if variant == "reference" and style == "concat":  # nn.MHA has no cache: it recomputes
        assert row["status"] == "unsupported"
        return
    assert row["status"] == "ok", row["error"]
    assert row["kv_cache"] == ("none" if variant == "reference" else style)


@pytest.mark.parametrize("seed", range(4))
def test_a_window_one_key_too_wide_is_caught_in_bfloat16_by_the_float32_check(seed):
    """At P=512, W=256, one new token, bfloat16's tolerance hides one key too many; the module
    in float32 does not. Its correct twin passes in both."""
    case = dict(
        dtype="bfloat16",
        kv_cache_len=512,
        seq_len=1,
        mask="sliding",
        window=256,
        seed=seed,
        variant={"window": 256},
    )
    wrong = verify("mistakes.WindowOneWide", **case)
    assert wrong["status"] == "mismatch", wrong
    right = verify("mistakes.OwnWindow", **case)
    assert right["status"] == "ok", right["error"]
    assert right["fp32_check"] == "ok" and right["fp32_check_s"] > 0


def test_float32_points_need_no_second_check_and_half_ones_say_theirs():
    assert not verify("fused", dtype="float32").get("fp32_check")
    assert verify("fused", dtype="float16", mask="causal").get("fp32_check") == "ok"


@pytest.mark.parametrize("variant", ["separate", "fused", "reference"])
@pytest.mark.parametrize("mask_format", ["bool", "additive"])
def test_left_padded_batched_decode_is_checked_against_nn_mha(variant, mask_format):
    """kv_cache_len with mask=padding: prompts of different lengths, left-padded in the cache;
    nn.MHA gets the matching key padding mask. Refused before."""
    row = verify(variant, **{**DECODE, "batch": 3}, mask="padding", mask_format=mask_format)
    assert row["status"] == "ok", row["error"]
    assert row["mask"] == "padding"


def test_a_decode_step_that_ignores_the_padding_is_a_mismatch():
    case = {**DECODE, "num_kv_heads": 8, "batch": 3}
    row = verify("mistakes.MaskNotApplied", **case, mask="padding")
    assert row["status"] == "mismatch"


def test_left_padding_pads_the_prompts_never_the_new_tokens():
    from harness.way.inputs import padding_mask

    mask = padding_mask(4, 8 + 2, left=8)  # B=4, P=8, L=2
    assert not mask[:, 8:].any()  # the new tokens
    assert mask.sum(1).tolist() == [0, 2, 4, 6]  # longest prompt first
    assert all(mask[b, : int(n)].all() for b, n in enumerate(mask.sum(1)))  # on the left


def test_recheck_tells_a_stateful_module_from_a_random_one():
    expected = torch.zeros(2, 3)
    state = {"n": 0}

    def grows():
        state["n"] += 1
        return (expected + state["n"], None)

    recheck = Recheck(expected, 1e-3, "cpu")
    said = recheck(Counted(grows), None)
    assert said.startswith("the output changed after 0 timed calls (max difference 1 >")

    def creeps():  # a cache grown long: each call changes the output a little, after a jump
        state["n"] += 1
        return (expected + 1 + state["n"] * 1e-6, None)

    said = recheck(Counted(creeps), None)
    assert said.startswith("the output changed after"), said

    def dropout():  # 1024 elements: two draws that agree by chance are 2^-1024 likely (6: 1/64)
        return (torch.nn.functional.dropout(torch.ones(32, 32), 0.5), None)

    said = Recheck(torch.zeros(32, 32), 1e-3, "cpu")(Counted(dropout), None)
    assert "differs from one call to the next" in said and "eval mode" in said

    calls = Counted(lambda: (expected.clone(), None))
    for _ in range(5):
        calls()
    assert recheck(calls, None) is None and calls.n == 6  # the re-check is one call


def test_the_progress_line_names_the_cache_style_and_a_decode_refusal_the_derived_mask():
    line = result_line({"status": "ok", "label": "fused", "kv_cache": "concat", "kv_cache_len": 8})
    assert "fused cache=concat" in line
    assert "cache=" not in result_line({"status": "ok", "label": "fused", "kv_cache": "static"})
    row = verify("fused", **DECODE, variant={"_supports_": {"mask": ["none"]}})
    assert row["status"] == "unsupported"
    assert (
        "mask=causal (a decode step, kv_cache_len, is causal: mask=none reads causal)"
        in (row["error"])
    )


def test_decode_with_backward_is_still_refused_in_one_line():
    with pytest.raises(InvalidPoint, match="mode=fwd_bwd: a decode step is inference"):
        verify("fused", **DECODE, mode="fwd_bwd")


def test_transformers_dynamic_cache_is_a_mismatch_without_a_rewind_and_ok_with_one():
    """The issue's case with the library's real cache: DynamicCache commits in ``update``."""
    pytest.importorskip("transformers", reason="transformers is not installed (CI installs it)")
    kept = time_it("hf_caches.DynamicKept", **DECODE, timing=QUICK)
    assert kept["status"] == "mismatch" and "the output changed after" in kept["error"]
    rewound = time_it("hf_caches.DynamicRewound", **DECODE, timing=QUICK)
    assert rewound["status"] == "ok", rewound["error"]
