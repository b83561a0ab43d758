"""A user's own pytest: MyAttention (examples/mine.py) is a drop-in for nn.MultiheadAttention.

Run it with `python -m pytest examples/test_dropin.py`. Each case builds MyAttention with the
weights of a real nn.MultiheadAttention, runs both on the same inputs, and compares outputs and
gradients with the float64 oracle's tolerances (docs/methodology.md).
"""

import pytest

from harness import assert_matches, time_it, verify
from examples.mine import MyAttention

SMALL = dict(batch=2, seq_len=16, embed_dim=32, num_heads=4, device="cpu", bias=False)


@pytest.mark.parametrize("mask", ["none", "causal", "padding"])
@pytest.mark.parametrize("mode", ["fwd", "fwd_bwd"])
def test_my_attention_matches_nn_mha(mask, mode):
    assert_matches(MyAttention, **SMALL, mask=mask, mode=mode)


def test_it_also_returns_nn_mhas_weights():
    assert_matches(MyAttention, **SMALL, need_weights=True, average_attn_weights=False)


def test_what_it_cannot_do_is_said_not_failed():
    # it has no biases: its constructor says so
    row = verify(MyAttention, **{**SMALL, "bias": True})
    assert row["status"] == "unsupported" and "no biases" in row["error"]


def test_it_is_timed_against_nn_mha_with_an_interval():
    row = time_it(MyAttention, **SMALL, timing={"warmup": 0.01, "rounds": 3, "round_time": 0.01})
    assert row["status"] == "ok"
    if row["latency_ms_ci_low"] is None:  # other processes spoiled all rounds but one: no interval
        pytest.skip(f"the machine was busy: no timing to assert ({row['contention']})")
    assert row["latency_ms_ci_low"] <= row["latency_ms_median"] <= row["latency_ms_ci_high"]
    assert row["speedup_ci_low"] <= row["speedup"] <= row["speedup_ci_high"]
