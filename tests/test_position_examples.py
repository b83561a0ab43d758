"""examples/litgpt_attention.py and examples/tune_attention.py: litgpt's CausalSelfAttention and
torchtune's MultiHeadAttention, library modules called otherwise than transformers' and writing
their caches at positions, behind the call hook and a PositionCache (variants/adapters.py): every
case nn.MHA's, a decode re-checked after timed calls (the cache set back each time), and an
adapter's mistake with each library's mask convention named. Skipped, with the reason, where the
library does not import."""

import itertools

import pytest

from harness import time_it, verify
from variants.adapters import identity_rotary, library

ADAPTERS = {  # variant target, the library module and class it wraps
    "litgpt": ("examples.litgpt_attention.LitGPTMHA", "litgpt.model", "CausalSelfAttention"),
    "torchtune": ("examples.tune_attention.TuneMHA", "torchtune.modules", "MultiHeadAttention"),
}
SMALL = dict(batch=2, embed_dim=32, num_heads=4)
MODES = ("fwd", "fwd_bwd")
CASES = [
    *(dict(mask=m, mode=o) for m, o in itertools.product(("none", "causal", "padding"), MODES)),
    dict(num_kv_heads=2, mask="causal", mode="fwd_bwd"),
    dict(dtype="bfloat16", mask="causal"),
    *(dict(kv_cache_len=8, seq_len=L, kv_cache=c) for L, c in ((1, "static"), (2, "concat"))),
    dict(kv_cache_len=8, seq_len=2, mask="padding", num_kv_heads=1),
]


def target(name: str) -> str:
    """The adapter's dotted path, or skip saying why its library does not import here."""
    path, module, cls = ADAPTERS[name]
    try:
        library(module, cls)
    except NotImplementedError as e:
        pytest.skip(f"{e}; install it beside torch: bash scripts/install-beside-torch.sh {name}")
    return path


def label(case: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in case.items())


@pytest.mark.parametrize("name", sorted(ADAPTERS))
@pytest.mark.parametrize("case", CASES, ids=label)
def test_a_librarys_positional_attention_is_nn_mha_at_prefill_and_decode(name, case):
    row = verify(target(name), **SMALL, **case)
    assert row["status"] == "ok", row["error"]
    if "kv_cache_len" in case:
        assert row["tensors_checked"] > 1  # the second step read what the first wrote


@pytest.mark.parametrize("name", sorted(ADAPTERS))
def test_a_positional_cache_is_set_back_before_every_timed_call(name):
    quick = {"rounds": 3, "round_time": 0.01, "warmup": 0.01}
    row = time_it(target(name), **SMALL, kv_cache_len=8, seq_len=1, timing=quick)
    assert row["status"] == "ok" and row["latency_ms_median"] > 0, row["error"]


def test_litgpt_handed_no_mask_reads_it_as_causal_and_the_diagnosis_says_so(monkeypatch):
    path = target("litgpt")
    from examples.litgpt_attention import LitGPTMHA

    def unmasked(self, x, mask, kwargs, kv_cache):  # the adapter's mistake: mask=None passed on
        return self.attn(x, *identity_rotary(x, self.head_dim), None, None), None

    monkeypatch.setattr(LitGPTMHA, "call", unmasked)
    row = verify(path, **SMALL, mask="none")
    assert row["status"] == "mismatch" and row["diagnosis"] == "causal_without_mask", row


def test_torchtune_handed_nn_mhas_bool_convention_is_named_as_an_inverted_mask(monkeypatch):
    path = target("torchtune")
    from examples.tune_attention import TuneMHA

    def hidden(self, x, mask, kwargs, kv_cache):  # True where nn.MHA hides: torchtune's "attend"
        return self.attn(x, x, mask=(mask[:, 0] == float("-inf")).expand(x.size(0), -1, -1)), None

    monkeypatch.setattr(TuneMHA, "call", hidden)
    row = verify(path, **SMALL, mask="causal")  # its last row hidden whole: SDPA's zeros
    assert row["status"] == "mismatch" and "attn_mask_inverted" in row["diagnosis"], row
