"""The textbook: matmul, scale, mask, softmax, matmul. The only kernel that returns the weights,
so every variant falls back to it when a point asks for them (as nn.MultiheadAttention does)."""

from __future__ import annotations

import math

import torch

from variants.kernels import Kernel
from variants.masks import Masks, top_left


def attend_with_weights(q, k, v, m: Masks) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, H, L, D), k/v (B, H, S, D) -> out (B, H, L, D), weights (B, H, L, S)."""
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))  # (B, H, L, S)
    if m.causal:
        hidden = m.once("top_left", lambda: top_left(m.L, m.S, q.device), str(q.device))  # (L, S)
        scores = scores.masked_fill(hidden, float("-inf"))
    mask = m.once("additive", lambda: m.merged(q.dtype, q.device), q.dtype, str(q.device))
    if mask is not None:
        scores = scores + mask
    if m.sinks is None:
        weights = torch.softmax(scores, dim=-1)  # (B, H, L, S)
    else:  # the sinks' column joins the softmax and is dropped after it (its value is zero)
        B, H, L, _ = scores.shape
        column = m.sink_column(scores.dtype).expand(B, H, L, 1)
        weights = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
    return weights @ v, weights  # (B, H, L, D)


def attend(q, k, v, m: Masks) -> torch.Tensor:
    return attend_with_weights(q, k, v, m)[0]


KERNEL = Kernel(
    name="manual",
    title="manual softmax attention",
    fn=attend,
    names_itself=False,
    scores=True,  # (B, H, L, S) scores and probabilities
    order=0,  # the textbook: the baseline of every other kernel
    doc="matmul, scale, mask, softmax, matmul (the scores are materialised)",
)
