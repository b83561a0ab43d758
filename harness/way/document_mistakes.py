"""The known mistakes of packed documents (mask=documents, issue 59): nn.MultiheadAttention's
``mask`` step with the documents' block-diagonal causal mask done wrong (harness/way/steps.py;
mistakes.py imports this module, which registers these in the catalogue). Each is derived from
the mask the point hands nn.MHA ((L, L), True or -inf where a query may not attend)."""

from __future__ import annotations

import torch

from harness.config import Point
from harness.way.steps import mask, mistake


def _documents(p: Point) -> bool:
    return p.mask == "documents" and (p.documents or 1) > 1


def _hidden(attn_mask: torch.Tensor) -> torch.Tensor:  # (L, L) bool, True = may not attend
    return attn_mask if attn_mask.dtype == torch.bool else torch.isneginf(attn_mask)


def _starts(hidden: torch.Tensor) -> torch.Tensor:  # (L,) each query's document's first key
    return (~hidden).int().argmax(dim=-1)


@mistake(
    "mask",
    "the documents' boundaries ignored (plain causal: a query sees the documents before its own)",
    "hide other documents' keys too: (doc[q] != doc[k]) | (k > q), a BlockMask's mask_mod",
    _documents,
)
def documents_leaked(m, attn_mask, key_padding_mask, L, S):
    causal = torch.ones(L, S, dtype=torch.bool, device=attn_mask.device).triu(1)
    return mask(m, causal, key_padding_mask, L, S)


@mistake(
    "mask",
    "each document's start off by one (its queries also see the previous document's last key)",
    "a document starts at its own first token: compare document ids, not ids shifted by one",
    _documents,
)
def documents_off_by_one(m, attn_mask, key_padding_mask, L, S):
    hidden = _hidden(attn_mask)
    before = (_starts(hidden) - 1).clamp(min=0)  # (L,): the key just before each document
    keys = torch.arange(S, device=hidden.device).view(1, S)
    return mask(m, hidden & (keys != before.view(L, 1)), key_padding_mask, L, S)


@mistake(
    "mask",
    "the documents bidirectional (each query sees its whole document, later tokens too)",
    "keep the causal part inside each document: (doc[q] != doc[k]) | (k > q)",
    _documents,
)
def documents_not_causal(m, attn_mask, key_padding_mask, L, S):
    hidden = _hidden(attn_mask)
    starts = _starts(hidden)  # (L,)
    same = starts.view(L, 1) == starts.view(1, S)  # query and key in one document
    return mask(m, ~same, key_padding_mask, L, S)
