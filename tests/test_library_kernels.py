"""attention=flash_attn|xformers: the libraries' kernels fed the hand-written variants' own
projections. Both are CUDA kernels: on a CPU the points are `unsupported` with the reason, and
where a package does not import, with how to install it. The CUDA checks run where both are
there (a GPU machine with `EXTRAS=xformers bash scripts/setup.sh` and flash-attn built)."""

import importlib.util
import itertools

import pytest
import torch

from harness.point import run_point
from harness.factory import make_point
from variants.masks import merge_masks

TINY = dict(batch=2, seq_len=16, embed_dim=32, num_heads=2, check_only=True)
MODULES = {"flash_attn": "flash_attn", "xformers": "xformers.ops"}


def importable(kernel: str) -> bool:
    try:
        importlib.import_module(MODULES[kernel])
        return True
    except Exception:  # ImportError, or a build for another torch
        return False


@pytest.mark.parametrize("kernel", ["flash_attn", "xformers"])
def test_a_library_that_does_not_import_is_unsupported_with_how_to_install_it(kernel):
    if importable(kernel):
        pytest.skip(f"{kernel} imports here")
    row = run_point(make_point("fused", **TINY, device="cpu", variant={"attention": kernel}))
    assert row["status"] == "unsupported"
    assert (
        f"{kernel} does not import here" in row["error"]
        and "install-beside-torch.sh" in row["error"]
    )


@pytest.mark.skipif(
    importlib.util.find_spec("xformers") is None,
    reason="xformers is not installed (EXTRAS=xformers bash scripts/setup.sh)",
)
def test_xformers_bias_is_nn_mhas_mask():
    """The bias handed to xformers, materialised by xformers itself, equals nn.MHA's merged mask:
    its LowerTriangularMask is top-left like nn.MHA's causal mask (also when L != S), and a
    tensor bias keeps the row alignment xformers asks for."""
    from variants.kernels.xformers import bias_for as xformers_bias

    B, H, L, S = 2, 3, 5, 7
    causal = torch.ones(L, S, dtype=torch.bool).triu(1)  # (L, S), True = may not attend
    padding = torch.zeros(B, S, dtype=torch.bool)
    padding[1, -3:] = True
    additive = torch.randn(L, S)
    for attn_mask, kpm, is_causal in [
        (causal, None, True),
        (None, padding, False),
        (None, padding, True),
        (additive, padding, False),
    ]:
        mask = merge_masks(None if is_causal else attn_mask, kpm, B, H, L, S, torch.float32)
        want = merge_masks(causal if is_causal else attn_mask, kpm, B, H, L, S, torch.float32)
        bias = xformers_bias(mask, is_causal, B, H, L, S)
        tensor = getattr(bias, "_bias", bias)  # LowerTriangularMaskWithTensorBias keeps it in _bias
        if isinstance(tensor, torch.Tensor):
            assert tensor.stride(-2) % 8 == 0  # rows start 16-byte aligned (float16)
        got = (
            bias
            if isinstance(bias, torch.Tensor)
            else bias.materialize((B, H, L, S), dtype=torch.float32)
        )
        assert torch.equal(got, want.expand(B, H, L, S)), (
            attn_mask is not None,
            kpm is not None,
            is_causal,
        )


@pytest.mark.parametrize("kernel", ["flash_attn", "xformers"])
def test_a_cuda_kernel_on_cpu_is_unsupported_by_its_declaration(kernel):
    if not importable(kernel):
        pytest.skip(f"{kernel} does not import here")
    row = run_point(make_point("fused", **TINY, device="cpu", variant={"attention": kernel}))
    assert row["status"] == "unsupported", row.get("error")
    assert f"device=cpu: attention={kernel} declares device=cuda" in row["error"]


@pytest.mark.skipif(
    torch.cuda.is_available() or not importable("xformers"),
    reason="needs xformers importable on a machine without CUDA",
)
def test_xformers_own_refusal_is_condensed_to_one_line():
    """Called directly (the harness refuses CPU points before this): xformers' reasons, one line."""
    from variants.kernels import xformers
    from variants.masks import Masks

    q = torch.randn(2, 2, 16, 16)  # (B, H, L, D)
    masks = Masks(
        None, None, causal=True, B=2, H=2, L=16, S=16, cache=lambda name, m, extra, build: build()
    )
    with pytest.raises(NotImplementedError) as caught:
        xformers.attend(q, q, q, masks)
    assert "memory_efficient_attention has no kernel for this point: device=cpu" in str(
        caught.value
    )
    assert "\n" not in str(caught.value)


CUDA_CASES = list(
    itertools.product(
        ("float16", "bfloat16"), ("none", "causal", "padding"), ("fwd", "fwd_bwd"), (False, True)
    )
)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kernel", ["flash_attn", "xformers"])
def test_library_kernel_matches_nn_mha_on_cuda(kernel):
    if not importable(kernel):
        pytest.skip(f"{kernel} does not import here")
    failed = []
    for dtype, mask, mode, cross in CUDA_CASES:
        row = run_point(
            make_point(
                "fused",
                **TINY,
                device="cuda",
                dtype=dtype,
                mask=mask,
                mode=mode,
                cross=cross,
                kv_seq_len=24 if cross else None,
                variant={"attention": kernel},
            )
        )
        # flash_attn_func takes no padding mask, and its causal mask is bottom-right when L != S
        expect_unsupported = kernel == "flash_attn" and (
            mask == "padding" or (mask == "causal" and cross)
        )
        want = "unsupported" if expect_unsupported else "ok"
        if row["status"] != want:
            failed.append(
                f"{dtype} {mask} {mode} cross={cross}: {row['status']} {row.get('error')}"
            )
    assert not failed, "\n".join(failed)
    timed = run_point(
        make_point(
            "fused",
            **{**TINY, "check_only": False},
            device="cuda",
            dtype="float16",
            variant={"attention": kernel},
            timing={"warmup": 0.001, "rounds": 2, "round_time": 0.001},
        )
    )
    assert timed["status"] == "ok" and timed["sdpa_kernel"] == kernel
