"""Attention sinks (gpt-oss; StreamingLLM's learned variant), ``sinks=true``: one logit s_h per
head joins every query's softmax as a column dropped after it (the real keys' weights sum to less
than one, the sink adds nothing to the output).

nn.MultiheadAttention expresses them exactly: ``add_zero_attn=True`` appends a zero key and value
(logit 0, output 0), and -s_h is added to every real key's logit in a float ``attn_mask`` (the
softmax ignores a shift common to a row). The sinks are an nn.Parameter of that nn.MHA
(``reference``): the state dict hands them to the module under test, and fwd_bwd compares their
gradients (``grad_sinks``) like any weight's. Vocabulary: B batch, H heads, L queries, S keys.
"""

from __future__ import annotations

import math

from harness.features import Feature, shown, torch
from harness.keys import key
from harness.validate import flag


def logits(H: int, S: int, gen):
    """(H,) float64, drawn from the point's seed: the heads spread over [-0.5, 1.5] * log(S) in a
    seeded order, plus a little noise. A sink of 0 weighs as one key of S (at S = 1024 a sink
    done wrong would change the output by 1/S, under any tolerance), so some heads' sinks weigh
    as much as their keys together or more, and some are negative."""
    spread = torch.linspace(-0.5, 1.5, H, dtype=torch.float64) if H > 1 else torch.ones(1) * 0.5
    order = torch.randperm(H, generator=gen)
    noise = 0.1 * torch.randn(H, generator=gen, dtype=torch.float64)
    return math.log(max(S, 2)) * spread[order].to(torch.float64) + noise


def expresses(model) -> bool:
    """Whether ``model`` is an nn.MHA that is handed its sinks in its mask (the zero key of
    ``add_zero_attn`` and a ``sinks`` parameter), not a module that applies them itself."""
    return (
        isinstance(model, torch.nn.MultiheadAttention)
        and model.add_zero_attn
        and isinstance(getattr(model, "sinks", None), torch.Tensor)
    )


def sink(m, scores):
    """The right step: (B, H, L, 1), each head's sink logit as a column of its scores."""
    B, H, L, _ = scores.shape
    return m.sinks.view(1, H, 1, 1).expand(B, H, L, 1)


class Sinks(Feature):
    keys = {
        "sinks": key(
            False,
            "true: attention sinks (gpt-oss): head h has a learned logit s_h that takes its share "
            "of every query's softmax and adds nothing to the output; nn.MHA expresses it as "
            "add_zero_attn=True with -s_h added to every real key's logit in a float attn_mask; "
            "a module applies it itself when its class takes sinks (its parameter `sinks`, H "
            "logits)",
            role="shape",
            after="window",
        )
    }
    steps = {"sink": ("column", sink)}
    required = True
    needs = "attention sinks: a parameter `sinks` of H logits; docs/adding.md says how to add them"
    handed = 2  # the float mask, and add_zero_attn's copy of it padded by the zero key
    examples = (dict(sinks=True, mask="causal", mode="fwd_bwd"),)

    def active(self, point) -> bool:
        return point.sinks is True

    def check(self, point, set_) -> None:
        flag("sinks", point.sinks)

    def argument(self, point) -> dict:
        return {"sinks": True}

    def reference(self, point, mha, gen) -> None:
        mha.add_zero_attn = True  # a zero key and value: the sink's column
        values = logits(point.num_heads, point.kv_seq_len, gen)  # (H,)
        mha.register_parameter("sinks", torch.nn.Parameter(values.to(mha.in_proj_weight.dtype)))

    def term(self, point, model, L: int, S: int, rows=None, like=None):
        if not expresses(model):
            return None  # it applies them itself
        return -model.sinks.view(-1, 1, 1)  # (H, 1, 1): with the sinks' gradient

    def case(self, row: dict) -> str:
        return "" if shown(row, "sinks", False) is None else " sinks"


FEATURE = Sinks()


@FEATURE.mistake(
    "sink",
    "no sinks (the softmax over the real keys only)",
    "append each head's sink logit to its scores before the softmax, drop that column after",
)
def sinks_missing(m, scores):
    return None


@FEATURE.mistake(
    "sink",
    "one sink for every head (head 0's)",
    "one sink logit per head: sinks.view(1, H, 1, 1), not sinks[0]",
    lambda p: FEATURE.active(p) and p.num_heads > 1,
)
def sinks_shared(m, scores):
    column = sink(m, scores)
    return column[:, :1].expand_as(column)


@FEATURE.mistake(
    "sink",
    "the sink added after the max subtraction (exp(s_h) where it is exp(s_h - max))",
    "subtract the row's max from the sink too, or concatenate the sink before the softmax",
)
def sinks_after_max(m, scores):
    top = scores.amax(dim=-1, keepdim=True)  # (B, H, L, 1): the real keys' max
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    return sink(m, scores) + top


@FEATURE.mistake(
    "sink",
    "the sink's sign flipped (-s_h joins the softmax)",
    "the sink's logit is +s_h, concatenated as it is",
)
def sinks_sign(m, scores):
    return -sink(m, scores)


@FEATURE.mistake(
    "sink",
    "the sink scaled by 1/sqrt(head_dim) (concatenated to the scores before their scaling)",
    "scale q . k first, then append the sink unscaled",
)
def sinks_scaled(m, scores):
    return sink(m, scores) * m.D**-0.5


@FEATURE.mistake(
    "sink",
    "the sinks detached (a buffer, or .detach(): they learn nothing)",
    "keep the sinks an nn.Parameter and use them without .detach() (or torch.no_grad())",
    lambda p: FEATURE.active(p) and p.mode == "fwd_bwd",
)
def sinks_detached(m, scores):
    return sink(m, scores).detach()
