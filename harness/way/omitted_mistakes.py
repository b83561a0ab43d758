"""The known mistakes that leave one of nn.MultiheadAttention's steps out (issue 59): a module
that skips a step computes something, and the diagnosis names what it skipped. The other
omissions (``scale_missing``, ``masks_ignored``, ``out_proj_skipped``, ``alibi_missing``) sit
with their step's mistakes in harness/way/mistakes.py and harness/way/position_mistakes.py;
mistakes.py imports this module, which registers these in the catalogue. A skipped softmax is
not among them: its unnormalised weights are orders of magnitude off, and in bfloat16 their own
rounding is past any tolerance, so it could not be told apart reliably."""

from __future__ import annotations

from harness.way.steps import Weights, mistake


@mistake(
    "project",
    "the input projections skipped (the query, key and value used as they came)",
    "project them first: q, k, v = F.linear(x, W_q, b_q), ... (nn.MHA's in_proj_weight rows)",
)
def in_proj_skipped(m, query, key, value, w: Weights):
    return query, key, value
