"""A sliding window's dense mask is made additive once, outside the timed calls, so that "window
vs causal" compares attention, not mask formats."""

from __future__ import annotations

import pytest
import torch

import variants.masks as masks_mod
from harness.way.build import build_variant
from harness.way.capabilities import variant_class
from harness.way.calls import collect
from harness.way.recheck import timed_call
from harness.way.inputs import make_inputs, make_reference
from harness.factory import make_point


def point(attention: str, **fields):
    return make_point(
        "fused",
        batch=2,
        seq_len=16,
        embed_dim=32,
        num_heads=4,
        device="cpu",
        variant={"attention": attention, "merge": "view"},
        **fields,
    )


@pytest.mark.parametrize("attention", ["sdpa", "manual"])
@pytest.mark.parametrize(
    "fields",
    [dict(mask="sliding", window=4), dict(mask="padding"), dict(mask="causal", kv_cache_len=8)],
)
def test_the_timed_call_does_not_rebuild_the_mask(monkeypatch, attention, fields):
    p = point(attention, **fields)
    reference = make_reference(p)
    model = build_variant(p, reference, variant_class(p.variant))
    call, _ = timed_call(model, model, make_inputs(p).to("cpu", torch.float32, False), p.mode)
    built = []
    real = masks_mod.merge_masks

    def counting(*args, **kwargs):
        built.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(masks_mod, "merge_masks", counting)
    for _ in range(5):
        call()
    assert len(built) <= 1  # the first call builds it, the other four reuse it


@pytest.mark.parametrize("attention", ["sdpa", "manual"])
def test_a_cached_window_mask_still_matches_nn_mha(attention):
    p = point(attention, mask="sliding", window=4)
    reference = make_reference(p)
    model = build_variant(p, reference, variant_class(p.variant))
    inputs = make_inputs(p).to("cpu", torch.float64, False)
    ref = collect(reference, reference, inputs, "fwd", reference.state_dict())["out"]
    model = model.double()  # float32 weights in float64: nn.MHA's output within 1e-6
    first, again = (
        collect(model, model, inputs, "fwd", reference.state_dict())["out"] for _ in range(2)
    )  # the second call takes the cached mask
    torch.testing.assert_close(first, ref, rtol=1e-5, atol=1e-6)
    assert torch.equal(again, first)
