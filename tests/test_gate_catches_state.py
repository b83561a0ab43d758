"""The gate (``check_only=true``) catches state: it repeats the checked call once, after the
rewind where there is one, and compares, so a KV cache that keeps what a call appends or a
position advanced inside forward is a ``mismatch`` without a timed run, with the sentence the
timed run's re-check gives (docs/methodology.md, "What was timed is what was checked").

The planted modules are in tests/negative/mistakes.py, each next to its correct twin."""

import sys

import pytest

from harness import time_it, verify
from tests.conftest import REPO

sys.path.insert(0, str(REPO / "tests" / "negative"))  # the gallery's modules

DECODE = dict(embed_dim=32, num_heads=8, num_kv_heads=2, kv_cache_len=8, seq_len=1, batch=2)
QUICK = {"rounds": 3, "round_time": 0.005, "warmup": 0.005}
REWIND = "give it a rewind (docs/adding.md, 'The KV cache contract')"


@pytest.mark.parametrize("seq_len", [1, 3])
def test_a_cache_that_is_not_rewound_is_a_mismatch_at_the_gate(seq_len):
    """At L=3 the repeated call attends to 2L new keys under its L x (P + L) mask: a shape
    error, which names the call and the rewind too."""
    row = verify("mistakes.CacheKept", **{**DECODE, "seq_len": seq_len})
    assert REWIND in row["error"], row
    if seq_len == 3:
        assert row["status"] == "error" and row["error"].startswith("RuntimeError: shape")
        assert "(at the checked call repeated (check_only): " in row["error"]
        return
    assert row["status"] == "mismatch", row
    assert "the output changed when the checked call was repeated" in row["error"]
    # the check's own tensors: the first step is right, the second followed the repeat
    assert row["check_passed"] is True and row["worst_tensor"] == "out"


def test_a_position_advanced_inside_forward_is_a_mismatch_at_the_gate():
    row = verify("mistakes.PositionKept", **{**DECODE, "seq_len": 3})
    assert row["status"] == "mismatch", row
    assert "the output changed when the checked call was repeated" in row["error"]
    assert REWIND in row["error"]
    prefill = verify("mistakes.PositionKept", embed_dim=32, num_heads=4, mask="causal")
    assert prefill["status"] == "mismatch" and REWIND in prefill["error"]


@pytest.mark.parametrize(
    "variant", ["mistakes.CacheRewound", "mistakes.PositionRewound", "separate", "fused"]
)
@pytest.mark.parametrize("seq_len", [1, 3])
def test_their_correct_twins_and_the_harness_caches_pass_the_gate(variant, seq_len):
    row = verify(variant, **{**DECODE, "seq_len": seq_len})
    assert row["status"] == "ok", row["error"]


def test_a_timed_run_of_a_position_kept_says_what_the_gate_says():
    gate = verify("mistakes.PositionKept", **{**DECODE, "seq_len": 3})
    timed = time_it("mistakes.PositionKept", **{**DECODE, "seq_len": 3}, timing=QUICK)
    assert timed["status"] == "mismatch" and REWIND in timed["error"]
    said = "the module or its KV cache keeps what a call leaves behind; " + REWIND
    assert said in gate["error"] and said in timed["error"]
    assert verify("mistakes.PositionRewound", **{**DECODE, "seq_len": 3})["status"] == "ok"


def test_an_exception_at_the_repeated_call_says_so_and_points_at_the_rewind():
    row = verify("mistakes.PositionAsserted", **DECODE)
    assert row["status"] == "error", row
    assert row["error"].startswith("AssertionError"), row["error"]
    assert "the checked call repeated" in row["error"] and REWIND in row["error"]


def test_the_gate_costs_one_call(monkeypatch):
    """One call more than the check made before: counted on the module's forward."""
    from variants.separate import SeparateProjMHA

    calls = []
    original = SeparateProjMHA.forward

    def counted(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(SeparateProjMHA, "forward", counted)
    verify("separate", **DECODE, check_max_logit=None)
    gate = len(calls)
    calls.clear()
    assert gate == 3  # the check's two decode steps, and the first repeated


def test_a_timed_call_that_raises_after_a_passing_check_points_at_the_rewind():
    row = time_it("mistakes.PositionAsserted", **DECODE, timing=QUICK)
    assert row["status"] == "error" and row["check_passed"] is True, row
    assert row["error"].startswith("AssertionError") and REWIND in row["error"]
    assert "after the check passed" in row["error"]
