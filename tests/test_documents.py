"""Packed documents (mask=documents, issue 59): the sequence packs N seeded documents and each
query sees its own document's keys up to itself. nn.MultiheadAttention with that block-diagonal
mask is the oracle, tested here equal to one causal call per document; the ways take it as any
mask (FlexAttention as a BlockMask that skips the blocks between documents)."""

import pytest
import torch
import torch.nn as nn

from harness.api import verify
from harness.config import InvalidPoint
from harness.factory import make_point
from harness.features.documents import document_ids, other_documents
from variants.fused import FusedQKVMHA

SHAPE = dict(batch=2, seq_len=16, embed_dim=32, num_heads=4, num_threads=1)


def test_the_packed_mask_is_one_causal_call_per_document():
    torch.manual_seed(0)
    L, N, E, H = 20, 4, 16, 2
    ids = document_ids(L, N, seed=3)
    assert ids[0] == 0 and ids[-1] == N - 1 and (ids.diff() >= 0).all()  # N in order, none empty
    assert len(set(ids.tolist())) == N and ids.tolist() != document_ids(L, N, seed=4).tolist()
    mha = nn.MultiheadAttention(E, H, batch_first=True, dtype=torch.float64)
    x = torch.randn(2, L, E, dtype=torch.float64)
    packed, _ = mha(x, x, x, attn_mask=other_documents(L, N, seed=3), need_weights=False)
    for d in range(N):
        part = x[:, ids == d]
        n = part.size(1)
        alone, _ = mha(part, part, part, attn_mask=torch.ones(n, n, dtype=torch.bool).triu(1),
                       need_weights=False)  # fmt: skip
        assert torch.allclose(packed[:, ids == d], alone, rtol=0, atol=1e-13)


@pytest.mark.parametrize(
    "variant, keys",
    [
        ("fused", {}),
        ("fused", dict(variant={"attention": "manual"}, mask_format="additive")),
        ("separate", dict(mode="fwd_bwd", need_weights=True)),
        ("packed", dict(num_kv_heads=2, dtype="bfloat16", position_bias="alibi")),
        ("reference", {}),
        # FlexAttention's BlockMask (a compile of about 15 s): make test-slow and CI
        pytest.param("fused", dict(variant={"attention": "flex"}), marks=pytest.mark.slow),
    ],
)
def test_the_ways_compute_packed_documents_as_nn_mha_does(variant, keys):
    row = verify(variant, **{**SHAPE, "mask": "documents", "documents": 3, **keys})
    assert row["status"] == "ok", (row["error"], row.get("max_abs_err"), row.get("tolerance"))


class Leaks(FusedQKVMHA):  # reads mask=documents as plain causal
    def forward(self, query, key, value, attn_mask=None, **kwargs):
        L = query.size(1)
        causal = torch.ones(L, L, dtype=torch.bool, device=query.device).triu(1)
        return super().forward(query, key, value, attn_mask=causal, **kwargs)


class Bidirectional(FusedQKVMHA):  # each query sees its whole document
    def forward(self, query, key, value, attn_mask=None, **kwargs):
        L = query.size(1)
        hidden = attn_mask if attn_mask.dtype == torch.bool else torch.isneginf(attn_mask)
        starts = (~hidden).int().argmax(dim=-1)
        return super().forward(
            query, key, value, attn_mask=starts.view(L, 1) != starts.view(1, L), **kwargs
        )


@pytest.mark.parametrize(
    "wrong, named", [(Leaks, "documents_leaked"), (Bidirectional, "documents_not_causal")]
)
def test_a_module_that_gets_the_documents_wrong_is_named(wrong, named):
    row = verify(wrong, **SHAPE, mask="documents", documents=3)
    assert row["status"] == "mismatch" and row["diagnosis"] == named, row["diagnosis"]


@pytest.mark.parametrize(
    "keys, said",
    [
        (dict(mask="documents"), "mask=documents needs documents=N"),
        (dict(documents=2), "documents=2 applies to mask=documents only"),
        (dict(mask="documents", documents=17), "documents=17 must be an integer 1 .. seq_len=16"),
        (dict(mask="documents", documents=2, cross=True), "mask=documents with cross=true"),
        (dict(mask="documents", documents=2, kv_cache_len=4), "mask=documents with kv_cache_len"),
    ],
)
def test_documents_refused_in_one_line_where_they_mean_nothing(keys, said):
    with pytest.raises(InvalidPoint, match="^" + said.replace(".", r"\.")):
        make_point("fused", **{**SHAPE, **keys})


def test_a_sampled_check_compares_every_documents_first_row():
    """Above 1024 tokens the check compares a sample of the query rows (harness/way/compared.py):
    a boundary mistake shows at a document's first row, so every one is among them."""
    from harness.way.compared import compared_rows

    point = make_point("fused", seq_len=2048, mask="documents", documents=6)
    ids = document_ids(2048, 6, point.seed)
    starts = set((ids.diff().nonzero().flatten() + 1).tolist())
    assert len(starts) == 5 and starts <= set(compared_rows(point).index)


def _masks(attn_mask, L, **kw):
    from variants.masks import Masks

    return Masks(attn_mask, None, causal=False, B=2, H=3, L=L, S=L, cache=None, **kw)


@pytest.mark.parametrize("additive", [False, True])
def test_one_call_per_document_splits_where_the_mask_says_and_nowhere_else(additive):
    """attention=per_document reads the documents from the mask nn.MHA is handed: its spans are
    the harness's split; a mask that is not block-diagonal causal, or one with a bias or sinks,
    is no split (one SDPA call)."""
    from variants.kernels.per_document import bounds

    L, N = 40, 6
    mask = other_documents(L, N, seed=4)
    if additive:
        mask = torch.zeros(L, L).masked_fill(mask, float("-inf"))
    ids = document_ids(L, N, seed=4)
    spans = bounds(_masks(mask, L))
    assert len(spans) == N and spans[0][0] == 0 and spans[-1][1] == L
    assert all(bool((ids[s:e] == ids[s]).all()) for s, e in spans)
    assert [ids[s].item() for s, _ in spans] == list(range(N))
    causal = torch.ones(L, L, dtype=torch.bool).triu(1)
    assert bounds(_masks(causal, L)) == [(0, L)]
    window = causal | ~torch.ones(L, L, dtype=torch.bool).triu(-3)  # a sliding window
    assert bounds(_masks(window, L)) is None
    assert bounds(_masks(mask, L, slopes=(0.5, 0.25, 0.125))) is None
    assert bounds(_masks(mask, L, sinks=torch.zeros(3))) is None


@pytest.mark.parametrize(
    "keys",
    [
        dict(mask="documents", documents=5),
        dict(mask="documents", documents=5, mode="fwd_bwd", num_kv_heads=2, dtype="bfloat16"),
        dict(mask="documents", documents=3, mask_format="additive"),
        dict(mask="padding"),  # one SDPA call
    ],
)
def test_one_call_per_document_computes_what_nn_mha_does(keys):
    shape = dict(batch=2, seq_len=40, embed_dim=48, num_heads=6, num_threads=1)
    row = verify("fused", **shape, variant={"attention": "per_document"}, **keys)
    assert row["status"] == "ok", (row["status"], row["error"])
