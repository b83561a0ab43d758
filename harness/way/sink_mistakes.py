"""The known mistakes of attention sinks (sinks=true, issue 59), each nn.MultiheadAttention's
math with its ``sink`` step done wrong (harness/way/steps.py; mistakes.py imports this module,
which registers these in the catalogue). The right step appends head h's logit s_h to each
query's scores as a column that joins the softmax and is dropped after it (harness/way/
sinks.py). Each wrong step returns the (B, H, L, 1) column a module computes in its place."""

from __future__ import annotations

import torch

from harness.config import Point
from harness.way.steps import mistake, sink


def _sinks(p: Point) -> bool:
    return p.sinks


@mistake(
    "sink",
    "no sinks (the softmax over the real keys only)",
    "append each head's sink logit to its scores before the softmax, drop that column after",
    _sinks,
)
def sinks_missing(m, scores):
    return None


@mistake(
    "sink",
    "one sink for every head (head 0's)",
    "one sink logit per head: sinks.view(1, H, 1, 1), not sinks[0]",
    lambda p: p.sinks and p.num_heads > 1,
)
def sinks_shared(m, scores):
    column = sink(m, scores)
    return column[:, :1].expand_as(column)


@mistake(
    "sink",
    "the sink added after the max subtraction (exp(s_h) where it is exp(s_h - max))",
    "subtract the row's max from the sink too, or concatenate the sink before the softmax",
    _sinks,
)
def sinks_after_max(m, scores):
    top = scores.amax(dim=-1, keepdim=True)  # (B, H, L, 1): the real keys' max
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    return sink(m, scores) + top


@mistake(
    "sink",
    "the sink's sign flipped (-s_h joins the softmax)",
    "the sink's logit is +s_h, concatenated as it is",
    _sinks,
)
def sinks_sign(m, scores):
    return -sink(m, scores)


@mistake(
    "sink",
    "the sink scaled by 1/sqrt(head_dim) (concatenated to the scores before their scaling)",
    "scale q . k first, then append the sink unscaled",
    _sinks,
)
def sinks_scaled(m, scores):
    return sink(m, scores) * m.D**-0.5


@mistake(
    "sink",
    "the sinks detached (a buffer, or .detach(): they learn nothing)",
    "keep the sinks an nn.Parameter and use them without .detach() (or torch.no_grad())",
    lambda p: p.sinks and p.mode == "fwd_bwd",
)
def sinks_detached(m, scores):
    return sink(m, scores).detach()
