"""A library's decoder attention, checked and timed through variants/adapters.py:
examples/hf_llama.py, hf_mistral.py, hf_qwen2.py, hf_gpt2.py and hf_gpt_neox.py wrap
transformers' real LlamaAttention, MistralAttention, Qwen2Attention, GPT2Attention and
GPTNeoXAttention and, at decode points, its real DynamicCache (kv_cache=concat) and StaticCache
(static). Skipped, saying why, where transformers does not import (CI installs
it); the helpers themselves are tested without it."""

from __future__ import annotations

import pytest
import torch

from harness import time_it, verify
from tests.conftest import REPO
from variants.adapters import MaskOnce, additive_mask, identity_rotary, qkvo_state

EXAMPLES = {
    "llama": "examples.hf_llama.LlamaMHA",
    "mistral": "examples.hf_mistral.MistralMHA",
    "qwen2": "examples.hf_qwen2.Qwen2MHA",
    "gpt2": "examples.hf_gpt2.GPT2MHA",
    "gpt_neox": "examples.hf_gpt_neox.GPTNeoXMHA",
}
SHAPE = dict(embed_dim=64, num_heads=8, num_kv_heads=2, batch=2)
UNGROUPED = ("gpt2", "gpt_neox")  # no grouped K/V heads: every head its own


def shape(name: str) -> dict:
    return {**SHAPE, "num_kv_heads": 8} if name in UNGROUPED else SHAPE


CASES = {
    "prefill causal": dict(seq_len=16, mask="causal"),
    "prefill padding": dict(seq_len=16, mask="padding"),
    "prefill window": dict(seq_len=16, mask="sliding", window=4),
    "backward": dict(seq_len=16, mask="causal", mode="fwd_bwd"),
    "decode static": dict(seq_len=1, kv_cache_len=16, kv_cache="static"),
    "decode concat": dict(seq_len=3, kv_cache_len=16, kv_cache="concat"),
    "decode window": dict(seq_len=2, kv_cache_len=16, mask="sliding", window=4),
    "decode left-padded": dict(seq_len=1, kv_cache_len=16, mask="padding"),
}


def transformers():
    return pytest.importorskip(
        "transformers",
        reason="transformers is not installed here: bash scripts/install-beside-torch.sh "
        "transformers (CI installs it)",
    )


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("name", list(EXAMPLES))
def test_each_example_matches_nn_mha(name, case, impl):
    transformers()
    row = verify(
        EXAMPLES[name], **shape(name), **CASES[case], variant={"attn_implementation": impl}
    )
    assert row["status"] == "ok", row["error"]
    assert "transformers" in row["variant_distribution"]  # the library's module ran
    if "kv_cache_len" in CASES[case]:
        assert row["kv_cache"] == CASES[case].get("kv_cache", "static")


# Each library's own rotary embeddings at its real configuration (transformers builds its
# ``{name}RotaryEmbedding`` from the point's rope_parameters: variants/library_rotary.py).
ROTARY = {
    "llama": dict(rotary="half", rotary_theta=500000.0, rotary_scaling="llama3",
                  rotary_factor=8.0, rotary_original=8),  # fmt: skip
    "mistral": dict(rotary="half", rotary_theta=1000000.0),
    "qwen2": dict(rotary="half", rotary_scaling="yarn", rotary_factor=4.0, rotary_original=8),
    "gpt_neox": dict(rotary="half", rotary_fraction=0.25),
    "gpt_oss": dict(rotary="half", sinks=True, rotary_theta=150000.0,
                    rotary_scaling="yarn_untruncated", rotary_factor=32.0, rotary_original=8),
}
ROTARY_CASES = ("prefill causal", "backward", "decode static", "decode concat", "decode window")


@pytest.mark.parametrize("case", ROTARY_CASES)
@pytest.mark.parametrize("name", list(ROTARY))
def test_each_examples_own_rotation_matches_the_oracle(name, case):
    transformers()
    target = EXAMPLES.get(name, "examples.hf_gpt_oss.GptOssMHA")
    if name == "gpt_oss":
        pytest.importorskip("transformers.models.gpt_oss", reason="no gpt_oss in this transformers")
    row = verify(target, **shape(name), **CASES[case], **ROTARY[name])
    assert row["status"] == "ok", (row["status"], row["error"], row["diagnosis"])
    assert row["rotary"] == "half" and "transformers" in row["variant_distribution"]


@pytest.mark.parametrize(
    "name, fields, words",
    [
        ("llama", dict(rotary="interleaved"), "rotary"),
        ("llama", dict(rotary="half", rotary_fraction=0.5), "turns every channel of a head"),
        ("gpt2", dict(rotary="half"), "rotary"),
    ],
)
def test_a_rotation_an_example_cannot_do_is_unsupported_saying_why(name, fields, words):
    transformers()
    row = verify(EXAMPLES[name], **shape(name), seq_len=8, mask="causal", **fields)
    assert row["status"] == "unsupported" and words in row["error"], row


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", list(EXAMPLES))
def test_each_example_holds_at_activation_scale_in_half_precision(name, dtype):
    """The activation-scale check (logits of 100, docs/methodology.md "Two scales") passes the
    library's attention in both half precisions, forward, backward and decode, both kernels."""
    transformers()
    failed = []
    for case in ("prefill causal", "backward", "decode static"):
        for impl in ("sdpa", "eager"):
            row = verify(
                EXAMPLES[name],
                **shape(name),
                **CASES[case],
                dtype=dtype,
                variant={"attn_implementation": impl},
            )
            if row["status"] != "ok" or row["act_check"] != "ok":
                failed.append(f"{case} {impl}: {row['status']} {row['act_check']} {row['error']}")
    assert not failed, "\n".join(failed)


def test_eager_returns_nn_mhas_weights_and_sdpa_says_it_cannot():
    transformers()
    case = dict(**SHAPE, seq_len=8, mask="causal", need_weights=True)
    row = verify(EXAMPLES["llama"], **case, variant={"attn_implementation": "eager"})
    assert row["status"] == "ok" and row["tensors_checked"] == 2, row["error"]
    row = verify(EXAMPLES["llama"], **case)
    assert row["status"] == "unsupported" and "returns no weights" in row["error"]


@pytest.mark.parametrize("style", ["static", "concat"])
def test_the_librarys_committing_caches_are_timed_as_checked(style):
    """transformers' caches commit every update: the adapter's rewind keeps every timed call on
    the prefix, and the re-check after the rounds passes (GPT-NeoX's too, handed its cache as
    ``layer_past``); without the rewind it fails."""
    transformers()
    case = dict(seq_len=1, kv_cache_len=16, kv_cache=style, dtype="bfloat16")
    quick = {"rounds": 3, "round_time": 0.01, "warmup": 0.01}
    for name in ("llama", "gpt_neox"):
        row = time_it(EXAMPLES[name], **shape(name), **case, timing=quick)
        assert row["status"] == "ok", row["error"]
        assert row["fp32_check"] == "ok" and row["latency_ms_median"] > 0
    case = {**SHAPE, **case}
    from variants.adapters import LibraryCache

    rewind = LibraryCache.rewind
    LibraryCache.rewind = lambda self: None  # as a user who forgot it
    try:
        row = time_it(EXAMPLES["llama"], **case, timing=quick)
    finally:
        LibraryCache.rewind = rewind
    if style == "concat":  # DynamicCache grows: the output changes
        assert row["status"] == "mismatch" and "the output changed after" in row["error"]
    else:  # StaticCache runs out of room: the library raises in the rounds
        assert row["status"] == "error", row


def test_qwen2s_bias_layout_passes_and_a_wrong_one_is_a_mismatch():
    transformers()
    row = verify(EXAMPLES["qwen2"], **SHAPE, seq_len=8, mask="causal", mode="fwd_bwd")
    assert row["status"] == "ok" and row["bias"] == "qkv" and "bias=qkv" in row["fixed"]
    # Qwen2's layout under a module that lost its value bias: the nonzero biases show
    from examples.hf_qwen2 import Qwen2MHA

    class NoValueBias(Qwen2MHA):
        def map_weights(self, state_dict, prefix):
            super().map_weights(state_dict, prefix)
            state_dict[prefix + "attn.v_proj.bias"] = torch.zeros_like(
                state_dict[prefix + "attn.v_proj.bias"]
            )

    import sys

    sys.modules[__name__].NoValueBias = NoValueBias  # importable by its dotted path
    NoValueBias.__qualname__ = "NoValueBias"
    row = verify(f"{__name__}.NoValueBias", **SHAPE, seq_len=8, mask="causal")
    assert row["status"] == "mismatch", row


def test_the_decoder_examples_sweep_through_the_cli(harness_cli, tmp_path):
    """As a user runs them: --config-dir examples/conf, causal and sliding in one sweep."""
    transformers()
    proc = harness_cli(
        "-m",
        "--config-dir",
        str(REPO / "examples" / "conf"),
        "variant=hf_llama,hf_mistral,hf_qwen2",
        "mask=causal,sliding",
        "window=4",
        "embed_dim=64",
        "num_heads=8",
        "num_kv_heads=2",
        "seq_len=16",
        "check_only=true",
        "hydra.sweep.dir=sweep",
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    import pandas as pd

    df = pd.read_csv(tmp_path / "sweep" / "results.csv")
    assert len(df) == 6 and (df["status"] == "ok").all(), df[["variant", "mask", "error"]]
    assert df[df["mask"] == "causal"]["window"].isna().all()  # the causal points: no window


def test_the_helpers_without_a_library():
    """qkvo_state maps nn.MHA's keys (grouped, with a bias layout); the mask is additive,
    never None, padded for a static cache and built once; the rotation is the identity."""
    E, H, Hkv = 8, 4, 2
    mha = torch.nn.MultiheadAttention(E, H, batch_first=True)
    with torch.no_grad():
        k = mha.in_proj_weight[E : 2 * E].view(Hkv, 2, 2, E)
        k.copy_(k[:, :1].expand_as(k).clone())  # K heads repeat in groups of 2
        v = mha.in_proj_weight[2 * E :].view(Hkv, 2, 2, E)
        v.copy_(v[:, :1].expand_as(v).clone())
    state = dict(mha.state_dict())
    qkvo_state(state, "", "attn.", H, Hkv, biases=(False, True))
    assert state["attn.k_proj.weight"].shape == (Hkv * 2, E)
    assert "attn.q_proj.bias" not in state and "attn.o_proj.bias" in state  # zero: dropped
    state = dict(mha.state_dict())
    with torch.no_grad():
        state["in_proj_bias"] = torch.ones(3 * E)
    with pytest.raises(ValueError, match="q_proj has no bias here"):
        qkvo_state(state, "", "attn.", H, Hkv, biases=(False, True))
    hidden = torch.ones(2, 3).bool().triu(1)  # (L=2, S=3): True = may not attend
    mask = additive_mask(hidden, None, 1, H, 2, 3, torch.float32, keys=5)
    assert mask.shape == (1, 1, 2, 5) and torch.isinf(mask[..., 3:]).all()
    assert additive_mask(None, None, 1, H, 2, 3, torch.float32).abs().sum() == 0  # not None
    once = MaskOnce()
    assert once(hidden, None, 1, H, 2, 3, torch.float32) is once(
        hidden, None, 1, H, 2, 3, torch.float32
    )
    cos, sin = identity_rotary(torch.zeros(2, 3, E), 2)
    assert (cos == 1).all() and (sin == 0).all() and cos.shape == (2, 3, 2)


def test_a_window_applies_to_the_sliding_points_of_a_sweep_only():
    """``mask=causal,sliding window=4,8``: the causal point runs once, without a window; with no
    sliding point the window stays, and each point refuses it."""
    from hydra_plugins.mha_bench.sweeper import windows_where_sliding

    jobs = [[f"mask={m}", f"window={w}"] for m in ("causal", "sliding") for w in (4, 8)]
    assert windows_where_sliding(jobs) == [
        ["mask=causal"],
        ["mask=sliding", "window=4"],
        ["mask=sliding", "window=8"],
    ]
    alone = [["mask=causal", "window=4"]]
    assert windows_where_sliding(alone) == alone
    assert windows_where_sliding([["window=4"]], mask="sliding") == [["window=4"]]


def test_a_window_without_a_sliding_point_is_still_refused(harness_cli, tmp_path):
    proc = harness_cli(
        "-m", "mask=causal", "window=4", "check_only=true", "seq_len=8", "hydra.sweep.dir=s"
    )
    assert proc.returncode != 0
    assert "window=4 applies to mask=sliding only" in proc.stdout + proc.stderr
