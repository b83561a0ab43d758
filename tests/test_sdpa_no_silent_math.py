"""SDPA never takes its math path unsaid (issue 71, D5): where no fused backend takes grouped
K/V heads with a mask (torch 2.11 on CUDA), the SDPA way hands SDPA every head's K/V, so a fused
backend runs and no (B, H, L, S) scores are held; a point pinned to the math path declares its
scores in its footprint."""

from __future__ import annotations

import pytest
import torch

from harness.factory import make_point
from harness.way.footprint import footprint, scores_of
from variants.kernels import sdpa
from variants.masks import Masks


def masks(B, H, L, S) -> Masks:
    made = {}

    def cache(name, masks, extra, build):
        if name not in made:
            made[name] = build()
        return made[name]

    hidden = torch.ones(L, S, dtype=torch.bool).triu(1)
    return Masks(hidden, None, causal=False, B=B, H=H, L=L, S=S, cache=cache)


@pytest.fixture
def torch_211(monkeypatch):
    """torch 2.11's backend checks on a CUDA device: grouped heads with a mask in no fused
    backend; every head's K/V in memory-efficient's."""
    monkeypatch.setattr(sdpa, "_cuda", lambda t: True)
    for name in ("can_use_flash_attention", "can_use_cudnn_attention"):
        monkeypatch.setattr(torch.backends.cuda, name, lambda params, debug=False: False)
    monkeypatch.setattr(
        torch.backends.cuda,
        "can_use_efficient_attention",
        lambda params, debug=False: not params.enable_gqa,
    )
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        calls.append((k.size(1), kw.get("enable_gqa", False)))
        return real(q, k, v, **kw)

    monkeypatch.setattr(sdpa.F, "scaled_dot_product_attention", spy)
    return calls


def test_grouped_heads_with_a_mask_get_every_heads_kv_where_fused_backends_refuse(torch_211):
    B, H, Hkv, L, D = 2, 8, 2, 16, 8
    q, k, v = torch.randn(B, H, L, D), torch.randn(B, Hkv, L, D), torch.randn(B, Hkv, L, D)
    m = masks(B, H, L, L)
    out = sdpa.attend(q, k, v, m)
    assert torch_211 == [(H, False)]  # expanded: what memory-efficient takes
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1),
        attn_mask=m.merged(q.dtype).masked_fill(torch.ones(L, L).bool().triu(1), float("-inf")),
    )  # fmt: skip
    torch.testing.assert_close(out, want)
    torch_211.clear()
    sdpa.attend(q, k, v, m)  # decided once per shape and dtype: the same again
    assert torch_211 == [(H, False)]


def test_grouped_heads_keep_enable_gqa_where_a_fused_backend_takes_them(monkeypatch, torch_211):
    monkeypatch.setattr(torch.backends.cuda, "can_use_efficient_attention", lambda p, d=False: True)
    q, k = torch.randn(1, 4, 8, 8), torch.randn(1, 2, 8, 8)
    sdpa.attend(q, k, k, masks(1, 4, 8, 8))
    assert torch_211 == [(2, True)]


def test_a_point_pinned_to_sdpas_math_path_declares_its_scores():
    point = make_point("fused", seq_len=64, embed_dim=32, num_heads=4, sdpa_backend="math")
    assert scores_of(point) and footprint(point, scores_of(point)).scores == 2 * 2 * 4 * 64 * 64
    assert not scores_of(make_point("fused", seq_len=64, embed_dim=32, num_heads=4))
