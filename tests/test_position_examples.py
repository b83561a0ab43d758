"""examples/litgpt_attention.py: litgpt's CausalSelfAttention, a library module called otherwise
than transformers' and writing its cache at positions, behind the call hook and a PositionCache
(variants/adapters.py). Skipped, with the reason, where litgpt does not import."""

import itertools

import pytest

from harness import verify
from variants.adapters import library

LITGPT = "examples.litgpt_attention.LitGPTMHA"
SMALL = dict(batch=2, embed_dim=32, num_heads=4)
MODES = ("fwd", "fwd_bwd")
CASES = [
    *(dict(mask=m, mode=o) for m, o in itertools.product(("none", "causal", "padding"), MODES)),
    dict(num_kv_heads=2, mask="causal", mode="fwd_bwd"),
    dict(dtype="bfloat16", mask="causal"),
    *(dict(kv_cache_len=8, seq_len=L, kv_cache=c) for L, c in ((1, "static"), (2, "concat"))),
    dict(kv_cache_len=8, seq_len=2, mask="padding", num_kv_heads=1),
]  # fmt: skip


@pytest.fixture(scope="module")
def litgpt():
    try:
        library("litgpt.model", "CausalSelfAttention")
    except NotImplementedError as e:
        pytest.skip(f"{e}; install it beside torch: bash scripts/install-beside-torch.sh litgpt")


@pytest.mark.parametrize("case", CASES, ids=lambda c: " ".join(f"{k}={v}" for k, v in c.items()))
def test_litgpts_attention_is_nn_mha_at_prefill_and_decode(litgpt, case):
    row = verify(LITGPT, **SMALL, **case)
    assert row["status"] == "ok", row["error"]
    if "kv_cache_len" in case:
        assert row["tensors_checked"] > 1  # the second step read what the first wrote


def test_litgpt_handed_no_mask_reads_it_as_causal_and_the_diagnosis_says_so(litgpt, monkeypatch):
    from examples.litgpt_attention import LitGPTMHA

    def unmasked(self, x, mask, kwargs, kv_cache):  # the adapter's mistake: mask=None passed on
        from variants.adapters import identity_rotary

        return self.attn(x, *identity_rotary(x, self.head_dim), None, None), None

    monkeypatch.setattr(LitGPTMHA, "call", unmasked)
    row = verify(LITGPT, **SMALL, mask="none")
    assert row["status"] == "mismatch" and row["diagnosis"] == "causal_without_mask", row
