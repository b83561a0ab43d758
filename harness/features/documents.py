"""Packed documents, ``mask=documents documents=N``: N documents one after another in a sequence
(a packed batch, as varlen attention and FlexAttention's document masks take it), each query
seeing its own document's keys up to itself.

nn.MultiheadAttention is handed the documents' block-diagonal causal mask (``attn_mask``), with
no ``is_causal`` hint (it is not plain causal). A sampled check compares each document's first
row (``rows``), where a boundary mistake shows first. The known mistakes are of nn.MHA's ``mask``
step, derived from the mask the point hands it.
"""

from __future__ import annotations

from harness.features import Feature, shown, torch
from harness.keys import key
from harness.validate import InvalidPoint, count, number, with_mask


def document_ids(L: int, N: int, seed: int):
    """(L,) each position's document: N documents packed one after another, cut at N - 1
    distinct seeded places (each document one token at least)."""
    gen = torch.Generator().manual_seed(seed + 5)  # its own stream: the inputs' draws unchanged
    ids = torch.zeros(L, dtype=torch.long)
    ids[torch.randperm(L - 1, generator=gen)[: N - 1] + 1] = 1  # a document starts there
    return ids.cumsum(0)


def other_documents(L: int, N: int, seed: int):
    """(L, L) bool, True = may not attend: a key after the query, or in another document."""
    ids = document_ids(L, N, seed)
    return (ids.view(L, 1) != ids.view(1, L)) | torch.ones(L, L, dtype=torch.bool).triu(1)


class Documents(Feature):
    keys = {
        "documents": key(
            None,
            "N, documents packed in the sequence with mask=documents (a seeded split, each at "
            "least one token); required by it, refused without it",
            role="shape",
            after="window",
        )
    }
    values = {
        "mask": {
            "documents": "the sequence packs `documents` documents, each query sees its own "
            "document's keys up to itself"
        }
    }
    examples = (dict(mask="documents", documents=3, mode="fwd_bwd"),)

    def active(self, point) -> bool:
        return point.mask == "documents"

    def check(self, point, set_) -> None:
        if not with_mask(point, "documents", "documents", "documents=N: how many the sequence "
                         "packs"):  # fmt: skip
            return
        unit = f"an integer 1 .. seq_len={point.seq_len} (each document one token at least)"
        number("documents", point.documents, 0, above=True, integer=True,
               below=point.seq_len + 1, unit=unit)  # fmt: skip
        if point.cross:
            raise InvalidPoint("mask=documents with cross=true: documents pack one sequence")
        if point.kv_cache_len is not None:
            raise InvalidPoint(
                "mask=documents with kv_cache_len: a decode step of packed documents is not "
                "modelled"
            )

    def attn_mask(self, point, L: int, S: int):
        return other_documents(L, point.documents, point.seed)  # (L, L)

    def rows(self, point) -> set:
        ids = document_ids(point.seq_len, point.documents, point.seed)
        return set((ids.diff().nonzero().flatten() + 1).tolist())  # each document's first row

    def case(self, row: dict) -> str:
        n = shown(row, "documents")
        return "" if n is None else f" docs={count(n)}"


FEATURE = Documents()


def _shows(p) -> bool:
    return FEATURE.active(p) and (p.documents or 1) > 1


def _hidden(attn_mask):  # (L, L) bool, True = may not attend
    return attn_mask if attn_mask.dtype == torch.bool else torch.isneginf(attn_mask)


def _starts(hidden):  # (L,) each query's document's first key
    return (~hidden).int().argmax(dim=-1)


@FEATURE.mistake(
    "mask",
    "the documents' boundaries ignored (plain causal: a query sees the documents before its own)",
    "hide other documents' keys too: (doc[q] != doc[k]) | (k > q), a BlockMask's mask_mod",
    _shows,
)
def documents_leaked(m, attn_mask, key_padding_mask, L, S):
    causal = torch.ones(L, S, dtype=torch.bool, device=attn_mask.device).triu(1)
    return m.right("mask")(m, causal, key_padding_mask, L, S)


@FEATURE.mistake(
    "mask",
    "each document's start off by one (its queries also see the previous document's last key)",
    "a document starts at its own first token: compare document ids, not ids shifted by one",
    _shows,
)
def documents_off_by_one(m, attn_mask, key_padding_mask, L, S):
    hidden = _hidden(attn_mask)
    before = (_starts(hidden) - 1).clamp(min=0)  # (L,): the key just before each document
    keys = torch.arange(S, device=hidden.device).view(1, S)
    return m.right("mask")(m, hidden & (keys != before.view(L, 1)), key_padding_mask, L, S)


@FEATURE.mistake(
    "mask",
    "the documents bidirectional (each query sees its whole document, later tokens too)",
    "keep the causal part inside each document: (doc[q] != doc[k]) | (k > q)",
    _shows,
)
def documents_not_causal(m, attn_mask, key_padding_mask, L, S):
    hidden = _hidden(attn_mask)
    starts = _starts(hidden)  # (L,)
    same = starts.view(L, 1) == starts.view(1, S)  # query and key in one document
    return m.right("mask")(m, ~same, key_padding_mask, L, S)
