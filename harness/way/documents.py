"""Packed documents (mask=documents, issue 59): N documents one after another in a sequence,
their seeded split and the mask nn.MultiheadAttention is handed for them. Imports nothing of the
harness: harness/way/inputs.py builds the mask, harness/way/rows.py samples each document's first
row.
"""

from __future__ import annotations

import torch


def document_ids(L: int, N: int, seed: int) -> torch.Tensor:
    """(L,) each position's document: N documents packed one after another, cut at N - 1
    distinct seeded places (each document one token at least)."""
    gen = torch.Generator().manual_seed(seed + 5)  # its own stream: the inputs' draws unchanged
    ids = torch.zeros(L, dtype=torch.long)
    ids[torch.randperm(L - 1, generator=gen)[: N - 1] + 1] = 1  # a document starts there
    return ids.cumsum(0)


def other_documents(L: int, N: int, seed: int) -> torch.Tensor:
    """(L, L) bool, True = may not attend: a key after the query, or in another document (packed
    documents' block-diagonal causal mask)."""
    ids = document_ids(L, N, seed)
    return (ids.view(L, 1) != ids.view(1, L)) | torch.ones(L, L, dtype=torch.bool).triu(1)
