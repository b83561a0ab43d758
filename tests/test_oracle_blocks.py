"""The float64 oracle in query blocks projects the key and value once: its work grows with the
query blocks' attention only, not with their count."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from harness.check.collect import collect_in_blocks, keys_projected_once
from harness.inputs import make_inputs, make_reference
from harness.factory import make_point


def oracle_flops(rows: int, **changes) -> int:
    p = make_point("fused", batch=1, seq_len=64, embed_dim=64, num_heads=4, device="cpu", **changes)
    model = make_reference(p)
    inputs = make_inputs(p).to("cpu", torch.float64, False)
    with FlopCounterMode(display=False) as count:
        collect_in_blocks(model, inputs, p.mode, model.state_dict(), rows=rows)
    return count.get_total_flops()


@pytest.mark.parametrize("changes", [dict(mask="causal"), dict(cross=True, kv_seq_len=48)])
def test_more_query_blocks_cost_no_more_key_and_value_projections(changes):
    """16 blocks of 4 rows against 2 of 32: the same work. A projection of the whole key and
    value in every block would make 16 blocks cost 5.2-5.7x as much at this shape (13x at
    sweep=llm's 8k prefill: 3.6e13 FLOP where one projection costs 2.2e12)."""
    few, many = oracle_flops(32, **changes), oracle_flops(4, **changes)
    assert many <= 1.02 * few, (few, many)


def test_the_projection_is_shared_only_within_the_blocks_and_without_grad():
    real = F._in_projection_packed
    with torch.no_grad(), keys_projected_once():
        assert F._in_projection_packed is not real
    assert F._in_projection_packed is real  # restored
    with torch.enable_grad(), keys_projected_once():  # a reused projection has one backward
        assert F._in_projection_packed is real
