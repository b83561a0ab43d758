"""nn.MHA's ALiBi bias is made where it is used (issue 71, D3): on the module's device, in its
dtype, not whole in float64 on the host (16 GiB per build at 8k tokens, 7 builds per shape);
float64 stays for the float64 oracle, which takes it a block of query rows at a time."""

from __future__ import annotations

import torch

from harness.factory import make_point
from harness.features.alibi import FEATURE, alibi, alibi_slopes


def point(**keys):
    return make_point("reference", batch=1, seq_len=64, embed_dim=64, num_heads=8,
                      position_bias="alibi", **keys)  # fmt: skip


def test_the_term_is_made_on_the_querys_device_in_its_dtype():
    p = point()
    model = torch.nn.MultiheadAttention(64, 8)  # takes no position_bias: it is handed the bias
    meta = torch.empty(0, dtype=torch.bfloat16, device="meta")
    term = FEATURE.term(p, model, 64, 64, like=meta)
    assert term.device.type == "meta" and term.dtype == torch.bfloat16  # no host tensor at all
    q = torch.empty(0, dtype=torch.bfloat16)
    made = FEATURE.term(p, model, 64, 64, like=q)
    whole = alibi(alibi_slopes(8), torch.arange(64), torch.arange(64))  # float64, as before
    assert made.dtype == torch.bfloat16 and torch.equal(made, whole.to(torch.bfloat16))


def test_the_oracle_keeps_float64_and_its_blocks_rows():
    p = point()
    model = torch.nn.MultiheadAttention(64, 8)
    rows = torch.tensor([3, 40])
    term = FEATURE.term(p, model, 64, 64, rows, like=torch.empty(0, dtype=torch.float64))
    assert term.dtype == torch.float64 and term.shape == (8, 2, 64)
    whole = alibi(alibi_slopes(8), torch.arange(64), torch.arange(64))
    assert torch.equal(term, whole[:, rows])
