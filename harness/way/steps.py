"""nn.MultiheadAttention's math in named steps (``Math``), and the registry of known mistakes:
each replaces one step (``mistake``; the mistakes themselves: harness/way/mistakes.py, and each
model feature's in its own module, harness/features/).

``Math`` is nn.MHA's forward (batch_first) written out in named steps, holding nn.MHA's
parameters under nn.MHA's names, so that ``harness.way.calls`` runs it exactly as it runs
the oracle: same inputs, masks, decode steps and gradients, by the same names. A mistake is one
function registered with ``@mistake(step, ...)``: it replaces that step and nothing else.

Steps and their signatures (``m`` is the ``Math`` module; B batch, L queries, S keys, E
embed_dim, H heads, D head_dim, G query heads per K/V head):

* ``weights(m) -> Weights``: the q, k, v and output weights and biases nn.MHA's state holds
* ``project(m, query, key, value, w) -> q, k, v``: (B, L|S, E) each
* ``split(m, x) -> (B, H, T, D)``: one projection's heads
* ``scale(m) -> float``: what the scores q . k are multiplied by
* ``mask(m, attn_mask, key_padding_mask, L, S) -> additive mask or None``, broadcast to
  (B, H, L, S)
* the active model features' steps (harness/features/), at their hook: ``qk`` steps
  ``(m, q, k, v, qpos, kpos) -> (q, k, v)`` turn the heads at their positions (rotary);
  ``bias`` steps ``(m, L, S) -> (H, L, S) or None`` add to the scores (ALiBi's ``position``);
  ``column`` steps
  ``(m, scores) -> (B, H, L, 1) or None`` join the softmax as a column dropped after it (the
  ``sink``). ``Math`` takes every feature's argument, as a module that computes it itself does,
  so it is handed nothing for them
* ``softmax(m, scores) -> probabilities``
* ``merge(m, o) -> (B, L, E)``: the heads' outputs (B, H, L, D) put back together
* ``project_out(m, x, w) -> (B, L, E)``
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from harness import features
from harness.config import Point
from harness.features import Mistake
from harness.way.calls import additive

STEPS = ("weights", "project", "split", "scale", "mask", "softmax", "merge", "project_out")
# Where each mistake is explained (tests/test_docs.py checks the section exists).
DOCS = 'docs/reference.md, "Known mistakes"'


class Weights(NamedTuple):
    q: torch.Tensor  # (E, E): rows are output channels, as nn.Linear's weight
    k: torch.Tensor
    v: torch.Tensor
    bq: torch.Tensor | None  # (E,)
    bk: torch.Tensor | None
    bv: torch.Tensor | None
    o: torch.Tensor  # (E, E)
    bo: torch.Tensor | None


CATALOGUE: list[Mistake] = []  # harness/features/'s Mistake: one type for every mistake


def mistake(
    step: str,
    says: str,
    fix: str,
    applies: Callable[[Point], bool] = lambda p: True,
    name: str | None = None,
):
    """Register the decorated function as a mistake replacing ``step``, named ``name`` (default:
    the function's name)."""
    if step not in STEPS:
        raise ValueError(f"step={step!r} is not one of {', '.join(STEPS)}")

    def shows(point: Point) -> bool:  # not where a feature computes that step its own way
        return applies(point) and not any(step in f.replaces for f in features.active(point))

    def register(fn):
        CATALOGUE.append(Mistake(name or fn.__name__, step, fn, says, fix, shows))
        return fn

    return register


# ----------------------------------------------------------------------------- the right steps


def weights(m) -> Weights:
    q, k, v = m.in_proj_weight.chunk(3)  # nn.MHA's rows: [Wq; Wk; Wv], each (E, E)
    bq = bk = bv = None
    if m.in_proj_bias is not None:
        bq, bk, bv = m.in_proj_bias.chunk(3)
    return Weights(q, k, v, bq, bk, bv, m.out_proj.weight, m.out_proj.bias)


def project(m, query, key, value, w: Weights):
    return F.linear(query, w.q, w.bq), F.linear(key, w.k, w.bk), F.linear(value, w.v, w.bv)


def split(m, x):  # (B, T, E) -> (B, H, T, D)
    B, T, _ = x.shape
    return x.view(B, T, m.H, m.D).transpose(1, 2)


def scale(m) -> float:
    return m.D**-0.5


def mask(m, attn_mask, key_padding_mask, L: int, S: int):
    """nn.MHA's rule: both masks made additive and added; attn_mask (L, S) or (B*H, L, S)."""
    out = None
    if attn_mask is not None:
        a = additive(attn_mask)
        out = a.view(1, 1, L, S) if a.dim() == 2 else a.view(-1, m.H, L, S)
    if key_padding_mask is not None:
        k = additive(key_padding_mask).view(-1, 1, 1, S)
        out = k if out is None else out + k
    return out


def softmax(m, scores):
    return torch.softmax(scores, dim=-1)  # over the keys


def merge(m, o):  # (B, H, L, D) -> (B, L, E)
    B, H, L, D = o.shape
    return o.transpose(1, 2).reshape(B, L, H * D)


def project_out(m, x, w: Weights):
    return F.linear(x, w.o, w.bo)


RIGHT = dict(
    weights=weights,
    project=project,
    split=split,
    scale=scale,
    mask=mask,
    softmax=softmax,
    merge=merge,
    project_out=project_out,
)


class Math(nn.Module):
    """nn.MultiheadAttention's forward in ``RIGHT``'s steps and the point's model features',
    ``wrong`` replacing one of them.

    Built from nn.MHA itself (its parameters copied under its names: ``in_proj_weight``,
    ``in_proj_bias``, ``out_proj.weight``, ``out_proj.bias``, and a feature's own), called
    as nn.MHA is: the gradients ``collect`` maps back are then nn.MHA's without a load hook."""

    def __init__(
        self,
        reference: nn.MultiheadAttention,
        point: Point,
        wrong: Mistake | None,
        safe: bool = False,
    ):
        """``safe``: a query row whose every key is hidden attends to nothing (zero weights),
        as SDPA and FlexAttention compute it, where a manual softmax gives NaN: a wrong mask
        that hides a whole row is matched either way (harness/way/diagnose.py)."""
        super().__init__()
        self.safe = safe
        self.E, self.H = point.embed_dim, point.num_heads
        self.D, self.G = self.E // self.H, point.groups
        self.point = point
        self.device = reference.in_proj_weight.device
        active = features.active(point)
        self.right_steps = {**RIGHT, **{k: fn for f in active for k, (_, fn) in f.steps.items()}}
        self.hooks = {h: [k for f in active for k, (at, _) in f.steps.items() if at == h]
                      for h in features.HOOKS}  # fmt: skip
        self.steps = dict(self.right_steps)
        if wrong is not None:
            self.steps[wrong.step] = wrong.fn
        self.in_proj_weight = nn.Parameter(reference.in_proj_weight.detach().clone())
        bias = reference.in_proj_bias
        self.in_proj_bias = None if bias is None else nn.Parameter(bias.detach().clone())
        self.out_proj = nn.Linear(self.E, self.E, bias=reference.out_proj.bias is not None)
        self.out_proj.to(reference.in_proj_weight.dtype)
        with torch.no_grad():
            self.out_proj.weight.copy_(reference.out_proj.weight)
            if self.out_proj.bias is not None:
                self.out_proj.bias.copy_(reference.out_proj.bias)
        for name, p in reference.named_parameters(recurse=False):  # a feature's own
            if name not in ("in_proj_weight", "in_proj_bias"):
                self.register_parameter(name, nn.Parameter(p.detach().clone()))
        for f in active:  # its argument, as a module that computes the feature itself takes it
            for name, value in f.argument(point).items():
                if name not in self._parameters:
                    setattr(self, name, value)

    def right(self, step: str):
        """The right ``step``: what a mistake changes one thing of."""
        return self.right_steps[step]

    def forward(
        self,
        query,
        key,
        value,
        key_padding_mask=None,
        need_weights=True,
        attn_mask=None,
        average_attn_weights=True,
        is_causal=False,  # nn.MHA's hint: the explicit attn_mask says it all
    ):
        do = self.steps
        L, S = query.size(1), key.size(1)
        w = do["weights"](self)
        q, k, v = (do["split"](self, t) for t in do["project"](self, query, key, value, w))
        for step in self.hooks["qk"]:  # a feature's turn of the heads at their positions (rotary)
            q, k, v = do[step](self, q, k, v, torch.arange(S - L, S), torch.arange(S))
        scores = (q @ k.transpose(-2, -1)) * do["scale"](self)  # (B, H, L, S)
        hidden = do["mask"](self, attn_mask, key_padding_mask, L, S)
        if hidden is not None:
            scores = scores + hidden.to(scores.dtype)
        for step in self.hooks["bias"]:  # a feature's bias, (H, L, S): ALiBi's
            added = do[step](self, L, S)
            if added is not None:
                scores = scores + added.to(scores.device, scores.dtype)
        hidden_rows = None
        if self.safe:  # a row with every key hidden attends to nothing, its gradient zero too
            hidden_rows = torch.isneginf(scores).all(dim=-1, keepdim=True)  # (B, H, L, 1)
            scores = scores.masked_fill(hidden_rows, 0.0)
        columns = [do[step](self, scores) for step in self.hooks["column"]]  # (B, H, L, 1) each
        columns = [c.to(scores.dtype) for c in columns if c is not None]
        if not columns:
            p = do["softmax"](self, scores)  # (B, H, L, S)
        else:  # the columns join the softmax and are dropped after it
            p = do["softmax"](self, torch.cat([scores, *columns], dim=-1))[..., :S]
        if hidden_rows is not None:
            p = p.masked_fill(hidden_rows, 0.0)
        out = do["project_out"](self, do["merge"](self, p @ v), w)  # (B, L, E)
        if not need_weights:
            return out, None
        return out, (p.mean(dim=1) if average_attn_weights else p)
