"""One F.scaled_dot_product_attention call per packed document (mask=documents): what a varlen
kernel does in one launch (FlashAttention's cu_seqlens, PyTorch's varlen_attn RFC), written as a
loop of causal calls over each document's slice.

The documents' bounds are read once from the mask nn.MHA is handed (outside the timed call), so
nothing of the harness's split is known to the kernel. Where the mask is not block-diagonal
causal (another mask, padding, cross-attention, a decode step), or a position bias or sinks are
asked for, the attention is one SDPA call with the merged mask (variants/kernels/sdpa.py): the
row then times what SDPA does, which is what this kernel would run there."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from variants.kernels import Kernel
from variants.kernels import sdpa
from variants.masks import Masks


def bounds(m: Masks) -> list[tuple[int, int]] | None:
    """[(start, end)] of each document, or None where the masks are not causal documents of one
    sequence. A query's document starts at the first key it may attend to; the mask must then
    be exactly "another document, or after the query" (True or -inf)."""
    plain = m.key_padding_mask is None and m.slopes is None and m.sinks is None
    if m.S != m.L or not plain:
        return None
    if m.attn_mask is None:
        return [(0, m.L)] if m.causal else None
    mask = m.attn_mask
    if mask.dim() == 3 and not (mask == mask[:1]).all():  # per batch row and head: not one split
        return None
    hidden = (mask if mask.dtype == torch.bool else torch.isneginf(mask)).reshape(-1, m.L, m.S)[0]
    if mask.dtype != torch.bool and not ((mask == 0) | hidden).all():  # a float bias, not a mask
        return None
    starts = (~hidden).int().argmax(dim=-1)  # (L,) each query's first key
    q = torch.arange(m.L, device=hidden.device)
    documents = (starts.view(-1, 1) != starts.view(1, -1)) | (q.view(1, -1) > q.view(-1, 1))
    if not torch.equal(hidden, documents):
        return None
    cuts = sorted(set(starts.tolist())) + [m.L]
    return list(zip(cuts[:-1], cuts[1:]))


def attend(q, k, v, m: Masks) -> torch.Tensor:
    """q (B, H, L, D), k/v (B, Hkv, L, D) -> out (B, H, L, D), one causal call per document."""
    spans = m.once("documents", lambda: bounds(m), str(q.device))
    if spans is None:
        return sdpa.attend(q, k, v, m)
    gqa = {"enable_gqa": True} if k.size(1) != q.size(1) else {}  # a torch without it: never
    out = [
        F.scaled_dot_product_attention(
            q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], is_causal=True, **gqa
        )
        for s, e in spans
    ]
    return out[0] if len(out) == 1 else torch.cat(out, dim=2)


KERNEL = Kernel(
    name="per_document",
    title="one SDPA call per document",
    fn=attend,
    gqa=sdpa.KERNEL.gqa,
    order=15,
    swept=False,  # a kernel of mask=documents (elsewhere SDPA): sweep=models names it
    memory="it holds no (L, S) scores in SDPA's fused backends",
    doc="one causal F.scaled_dot_product_attention call per packed document (mask=documents; "
    "any other mask: one SDPA call)",
)
