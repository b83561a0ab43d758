"""attention=flex (FlexAttention, compiled inside the variant): masks as block masks or a
score_mod, checked against nn.MultiheadAttention. One small compiled test (each mask kind is a
compile of several seconds on 2 cores), so only two kinds and one structure here."""

from harness.point import run_point
from harness.factory import make_point

TINY = dict(batch=2, seq_len=16, embed_dim=16, num_heads=2, device="cpu", check_only=True)


def test_flex_matches_nn_mha_with_a_block_mask_and_a_score_mod_and_records_its_compile():
    import torch._dynamo

    # a test file that ran before this one in the same pytest worker may have compiled this
    # shape's kernel already: its compile is recorded only where Dynamo starts empty
    torch._dynamo.reset()
    causal = run_point(make_point("fused", **TINY, mask="causal", variant={"attention": "flex"}))
    assert causal["status"] == "ok", causal["error"]  # bool causal mask: a block mask
    assert causal["compile_s"] > 0 and causal["compiled_graphs"] >= 1  # compiled inside the variant
    padded = run_point(
        make_point(
            "fused", **TINY, mask="padding", mask_format="additive", variant={"attention": "flex"}
        )
    )
    assert padded["status"] == "ok", padded["error"]  # an additive float mask: a score_mod
    again = run_point(
        make_point("fused", **TINY, mask="causal", seed=1, variant={"attention": "flex"})
    )
    assert (
        again["status"] == "ok" and again["compile_s"] is None
    )  # same shape and mask kind: no recompile


def test_flex_backward_on_cpu_is_unsupported_with_torchs_reason():
    row = run_point(make_point("fused", **TINY, mode="fwd_bwd", variant={"attention": "flex"}))
    assert row["status"] == "unsupported"
    assert "FlexAttention does not support backward on CPU" in row["error"]


def test_a_timed_flex_point_reports_flex_as_its_kernel_and_compiles_nothing_while_timed():
    row = run_point(
        make_point(
            "fused",
            **{**TINY, "check_only": False},
            mask="causal",
            variant={"attention": "flex"},
            timing={"warmup": 0.001, "rounds": 2, "round_time": 0.001},
        )
    )
    assert row["status"] == "ok", row["error"]
    assert row["sdpa_kernel"] == "flex" and row["recompiles"] == 0


def test_masks_are_built_once_per_mask_and_again_after_an_in_place_change():
    """Block masks and xformers' bias are built outside the timed call, keyed on the mask
    tensors and their in-place version: a changed mask is never served a stale build."""
    import torch

    from variants.fused import FusedQKVMHA

    module, built = FusedQKVMHA(16, 2, attention="flex"), []
    mask = torch.zeros(2, 5, dtype=torch.bool)

    def build():
        built.append(1)
        return object()

    first = module.cached("flex", (None, mask), (False, 2, 5, 5), build)
    assert module.cached("flex", (None, mask), (False, 2, 5, 5), build) is first and len(built) == 1
    mask[0, -1] = True  # in place: the tensor's version moves
    module.cached("flex", (None, mask), (False, 2, 5, 5), build)
    module.cached("flex", (None, mask.clone()), (False, 2, 5, 5), build)  # another tensor
    module.cached("flex", (None, mask.clone()), (True, 2, 5, 5), build)  # another shape or flag
    assert len(built) == 4
