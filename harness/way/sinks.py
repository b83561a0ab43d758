"""Attention sinks as nn.MultiheadAttention takes them: the oracle's side (issue 59).

A sink (gpt-oss; StreamingLLM's learned variant) is one logit s_h per head that joins every
query's softmax as an extra column and is dropped after it: the real keys' weights sum to less
than one, and the sink adds nothing to the output. nn.MHA has no sinks, but it expresses them
exactly: ``add_zero_attn=True`` appends a zero key and a zero value (logit 0, output 0), and
-s_h added to every real key's logit through a float ``attn_mask`` (``handed``: the softmax
ignores a shift common to a row, so the zero key weighs as a logit of s_h would). The sink
logits are an nn.Parameter of that nn.MHA (``attach``), so the state dict hands them to the
module under test and fwd_bwd compares their gradients (``grad_sinks``) like any weight's.

A module of any other class applies its own sinks (its class takes ``sinks``, harness/way/
build.py); nn.MHA, the oracle and the reference way, is handed them in its mask (``expresses``).
Vocabulary: B batch, H heads, L queries, S keys.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn


def logits(H: int, S: int, gen: torch.Generator) -> torch.Tensor:
    """(H,) float64, drawn from the point's seed: the heads spread over [-0.5, 1.5] * log(S) in a
    seeded order, plus a little noise. A sink of 0 weighs as one key of S: a sink done wrong
    would hide under the tolerance, so some heads' sinks weigh as much as their keys together
    (log S) or more, and some are negative, where a sign flipped or a sink dropped differ."""
    spread = torch.linspace(-0.5, 1.5, H, dtype=torch.float64) if H > 1 else torch.ones(1) * 0.5
    order = torch.randperm(H, generator=gen)
    noise = 0.1 * torch.randn(H, generator=gen, dtype=torch.float64)
    return math.log(max(S, 2)) * spread[order].to(torch.float64) + noise


def attach(model: nn.MultiheadAttention, values: torch.Tensor) -> None:
    """Give nn.MHA (built with ``add_zero_attn=True``) its sinks: the parameter ``sinks`` (H,)."""
    model.register_parameter("sinks", nn.Parameter(values.to(model.in_proj_weight.dtype)))


def expresses(model) -> bool:
    """Whether ``model`` is an nn.MHA that is handed its sinks in its mask (the zero key of
    ``add_zero_attn`` and a ``sinks`` parameter), not a module that applies them itself."""
    return (
        isinstance(model, nn.MultiheadAttention)
        and model.add_zero_attn
        and isinstance(getattr(model, "sinks", None), torch.Tensor)
    )


def term(model) -> torch.Tensor:
    """(H, 1, 1): what nn.MHA's mask adds to every real key's logit, -s_h; differentiable, so that
    the sinks' gradient reaches ``model.sinks`` through the mask."""
    return -model.sinks.view(-1, 1, 1)


def real_keys(weights: torch.Tensor | None) -> torch.Tensor | None:
    """nn.MHA's attention weights (..., S + 1) without the zero key's column: the real keys'
    weights, as a module with sinks returns them (the sink's share is 1 minus their sum)."""
    return None if weights is None else weights[..., :-1]
