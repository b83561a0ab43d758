"""What a waiting point holds is what its timed call can reach (issue 71, D2): a kernel's cached
ALiBi mask and nn.MHA's handed float mask are made for the module after the inputs were counted;
a block's budget that leaves them out over-fills a GPU at 8k tokens (4 GiB each)."""

from __future__ import annotations

import torch

from harness.factory import make_point
from harness.measure.memory import reachable_bytes
from harness.point import prepare_point

SHAPE = dict(batch=2, seq_len=256, embed_dim=64, num_heads=4, mask="causal", check_only=False)


def held(way, **keys) -> int:
    record, session = prepare_point(make_point(way, **SHAPE, **keys), peaks=1.0)
    assert record.status == "ok" and session is not None, record.outcome.error
    return session.nbytes


def test_the_sdpa_ways_cached_alibi_mask_is_counted():
    H, L = SHAPE["num_heads"], SHAPE["seq_len"]
    mask = H * L * L * 4  # (1, H, L, S) float32, built once outside the timed call
    assert held("fused", variant={"attention": "sdpa"}, position_bias="alibi") >= mask


def test_nn_mhas_handed_float_mask_is_counted():
    B, H, L = SHAPE["batch"], SHAPE["num_heads"], SHAPE["seq_len"]
    handed = B * H * L * L * 4  # (B*H, L, S) float32 in its attn_mask
    assert held("reference", position_bias="alibi") >= handed


def test_the_walk_counts_each_storage_once_through_closures_and_modules():
    t = torch.zeros(1000)
    module = torch.nn.Linear(10, 10, bias=False)  # 400 bytes
    module.cache = {"mask": (t[:10], t)}  # a view: the same storage

    def call():
        return module, t

    assert reachable_bytes(call) == 4000 + 400
    assert reachable_bytes(lambda: None) == 0
