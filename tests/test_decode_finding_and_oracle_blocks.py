"""The decode finding's reason and the float64 oracle's cost in query blocks, on the CPU.

The decode finding: a copy reads and writes every byte it counts and a decode step mostly reads,
so a step can beat the copy bandwidth from memory. On CUDA the L2 is flushed before every timed
call (timing.flush_l2), and bytes larger than the last-level cache cannot have stayed in it: the
finding says a step's bytes "may have stayed in the caches" only on a CPU, for bytes that fit.

The float64 oracle in query blocks (harness/way/calls.py, docs/architecture.md's Known traps)
projects the whole key and value once, with grad too: 2.2e12 FLOP at sweep=llm's 8k prefill, where
a projection in every block would cost 3.6e13. Counted here with FlopCounterMode, which counts
work, not time, so the tests do not depend on the machine's speed.
"""

from __future__ import annotations

import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from harness.way.calls import collect
from harness.way.calls import collect_in_blocks
from harness.way.inputs import make_inputs, make_reference
from harness.report.findings import decode_finding
from harness.factory import make_point

MiB = 2**20

# --- the decode finding --------------------------------------------------------------------------


def decode_row(device: str, mib: float, pct: float, **extra) -> pd.DataFrame:
    """One timed decode row whose step moves ``mib`` MiB at ``pct`` % of the copy bandwidth."""
    copy = 3.0e3
    row = dict(
        status="ok",
        latency_ms_median=0.1,
        variant="fused",
        label="fused/attention=sdpa",
        compile="off",
        kv_cache_len=32768,
        kv_cache="static",
        device=device,
        gbps=copy * pct / 100,
        copy_gbps=copy,
        pct_of_copy_bw=pct,
        bytes_per_call=mib * MiB,
        speedup=12.0,
        **extra,
    )
    return pd.DataFrame([row])


def test_decode_on_cuda_above_copy_is_reads_against_a_copy_never_the_flushed_l2():
    """sweep=llm's CUDA decode at P=32768: 257 MiB a step at 115% of an H100's copy rate (reads
    near 3.3 TB/s, a copy's counted rate lower). Its 50 MB L2 is flushed before every call."""
    text = decode_finding(decode_row("cuda", 257, 115))
    assert "115% of copy" in text
    assert "stayed" not in text and "caches" not in text
    assert "a copy writes every byte it reads, a decode step mostly reads" in text


def test_decode_on_a_cpu_says_cached_only_for_bytes_a_last_level_cache_holds():
    """17 MiB (sweep=llm's CPU step at P=2048) may have stayed in a 32 MiB L3; 1 GiB cannot
    have stayed in any CPU's."""
    assert "may have stayed in the CPU's caches" in decode_finding(decode_row("cpu", 17, 112))
    big = decode_finding(decode_row("cpu", 1024, 112))
    assert "stayed" not in big and "mostly reads" in big


def test_decode_below_copy_needs_no_reason():
    text = decode_finding(decode_row("cuda", 257, 80))
    assert "(80% of copy)" in text and "mostly reads" not in text


# --- the oracle's key and value projection --------------------------------------------------------

SHAPE = dict(batch=2, seq_len=64, embed_dim=32, num_heads=4, device="cpu")

# fwd as sweep=llm's prefill runs it (no weights: SDPA), and the blocked cases with grad
# (point.yardsticks blocks with grad only when the weights are asked for).
CASES = [
    dict(mask="causal"),
    dict(mask="padding", cross=True, kv_seq_len=48, need_weights=True),
    dict(mask="causal", mode="fwd_bwd", need_weights=True),
    dict(mask="padding", mode="fwd_bwd", need_weights=True, cross=True, kv_seq_len=48),
    dict(mask="causal", mode="fwd_bwd", need_weights=True, num_kv_heads=2),
    # a float mask nn.MHA is handed (issue 59), built a block's rows at a time
    dict(mask="causal", position_bias="alibi", mode="fwd_bwd", need_weights=True),
    dict(mask="padding", sinks=True, mode="fwd_bwd", need_weights=True, num_kv_heads=2),
]
# A decode step with both, and its second step (whose projections the FLOP count above leaves
# out): blocks equal the whole too.
DECODE = dict(kv_cache_len=20, seq_len=8, position_bias="alibi", sinks=True, mask="padding")


def oracle(rows: int, **changes):
    """The float64 oracle of a point in blocks of ``rows`` query rows: (point, tensors, the
    FLOPs of every op it ran, by op name)."""
    p = make_point("fused", **{**SHAPE, **changes})
    model = make_reference(p)
    inputs = make_inputs(p).to("cpu", torch.float64, p.mode == "fwd_bwd")
    with FlopCounterMode(display=False) as count:
        tensors = collect_in_blocks(model, inputs, p.mode, model.state_dict(), rows=rows)
    by_op = {str(op): n for op, n in count.get_flop_counts()["Global"].items()}
    return p, tensors, by_op


def projection_flops(p) -> int:
    """nn.MHA's linears run once over the whole point: Q and the output over L rows, K and V
    over S rows, 2·E² FLOP a row each; with grad, their backward twice that (docs/methodology.md,
    Throughput)."""
    once = 2 * p.batch * p.embed_dim**2 * (2 * p.seq_len + 2 * p.kv_seq_len)
    return once * (3 if p.mode == "fwd_bwd" else 1)


@pytest.mark.parametrize("changes", CASES)
def test_the_oracle_in_blocks_projects_key_and_value_once(changes):
    """16 blocks of 4 rows: the linears (addmm, and mm for their backward; attention runs in
    bmm or SDPA) cost what one projection of the whole point costs; a projection of the key
    and value in every block would cost 7.4-8.5x that at this shape."""
    p, _, by_op = oracle(4, **changes)
    linears = by_op.get("aten.addmm", 0) + by_op.get("aten.mm", 0)
    assert linears == projection_flops(p), (linears, projection_flops(p), by_op)


@pytest.mark.parametrize("changes", [*CASES, DECODE])
def test_the_oracle_in_blocks_is_the_whole_one(changes):
    """The shared projection changes the work, not the result: output, weights and every
    gradient (the key and value's summed over the blocks, then back-propagated once) equal
    nn.MHA's on the whole query up to float64 rounding."""
    p, blocks, _ = oracle(4, **changes)
    model = make_reference(p)
    inputs = make_inputs(p).to("cpu", torch.float64, p.mode == "fwd_bwd")
    whole = collect(model, model, inputs, p.mode, model.state_dict())
    assert set(blocks) == set(whole)
    for name in whole:
        torch.testing.assert_close(blocks[name], whole[name], rtol=1e-12, atol=1e-12, msg=name)


def test_the_mask_nn_mha_is_handed_comes_a_block_at_a_time(monkeypatch):
    """ALiBi and sinks reach nn.MHA in a float (B*H, L, S) mask, as large as the scores (17 GB in
    float64 at B=1, H=32, L=8192): the oracle in blocks hands it a block's rows at a time."""
    from harness.way import calls

    seen = []

    def spy(kwargs, term, B, H, L, S, dtype, device):
        out = yardsticks_handed(kwargs, term, B, H, L, S, dtype, device)
        seen.append(tuple(out["attn_mask"].shape))
        return out

    yardsticks_handed = calls.handed
    monkeypatch.setattr(calls, "handed", spy)
    p, _, _ = oracle(4, mask="causal", position_bias="alibi", sinks=True, mode="fwd_bwd")
    assert seen and set(seen) == {(p.batch * p.num_heads, 4, p.kv_seq_len)}, seen


def test_a_failed_block_leaves_nn_mha_as_it_was():
    """An exception in a block restores nn.MHA's own in-projection and back-propagates
    nothing: the shared projection lives for one oracle call."""
    from harness.way.projection import keys_projected_once

    real = F._in_projection_packed
    with pytest.raises(RuntimeError, match="block"):
        with torch.enable_grad(), keys_projected_once(backward=True):
            assert F._in_projection_packed is not real
            raise RuntimeError("block failed")
    assert F._in_projection_packed is real


def test_the_projection_is_shared_only_within_the_blocks_and_without_grad():
    from harness.way.projection import keys_projected_once

    real = F._in_projection_packed
    with torch.no_grad(), keys_projected_once():
        assert F._in_projection_packed is not real
    assert F._in_projection_packed is real  # restored
    with torch.enable_grad(), keys_projected_once():  # a reused projection has one backward
        assert F._in_projection_packed is real
