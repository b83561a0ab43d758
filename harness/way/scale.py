"""Inputs at activation scale: the point's inputs with a few outlier channels scaled up until
nn.MultiheadAttention's attention logits reach ``check_max_logit`` (docs/methodology.md, "Two
scales").

The point's own inputs are unit-scale: standard-normal tokens through weights of 1/sqrt(fan_in)
give logits below about 4, where a softmax that never subtracts its row max cannot overflow.
Real activations carry outliers of 10-100x in a few channels, and real attention logits reach
tens to hundreds (what QK-norm and logit soft-capping exist to contain). So the check runs once
more on the same inputs with ``OUTLIER_CHANNELS`` channels of every token (query, key, value,
a decode point's cached prefix and next step) multiplied by one factor, chosen so that the
largest q . k / sqrt(head_dim) over every head, query and key the point's calls see is the
target. The largest, not the largest in magnitude: exp overflows on the positive side (float32
and bfloat16 past 88.7, float16 past 11.1); the negative side reaches about as far. Only those
channels change: the masks, the upstream gradient and the other channels are
the point's own.

Vocabulary: B batch, T tokens, E embed_dim, H heads, D head_dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from harness.way.calls import Inputs

# How many channels carry the outliers (at most E // 8): real models show "massive activations"
# in a handful of fixed channels whatever their width.
OUTLIER_CHANNELS = 4
# The factor is searched to this relative precision of the logit, then rounded to 3 significant
# digits: the same factor on every device and dtype for one shape and seed.
PRECISION = 0.01
# Logits computed (B x H x query rows x keys): every query row while they fit, else rows spread
# evenly over the sequence (the last one included). The largest logit of that sample is what is
# stated and reached; the search holds three such float64 matrices per call (96 MiB at most).
MAX_LOGITS = 2**22
# The largest outlier factor tried: past it the point cannot reach the target (its outlier
# channels barely reach the queries or keys) and the pass says so.
LARGEST = 1e4


@dataclass(frozen=True)
class Scale:
    channels: tuple[int, ...]  # the outlier channels
    factor: float  # what they are multiplied by
    max_logit: float  # the largest logit nn.MHA computes on the scaled inputs (sampled rows)
    signed: bool = True  # False: the largest in magnitude (``Logits.magnitude``)

    def describe(self) -> str:
        what = "largest logit" if self.signed else "largest |logit|"
        return (
            f"{what} {self.max_logit:.0f}: {len(self.channels)} outlier channels x{self.factor:.3g}"
        )


def channels(E: int, seed: int) -> tuple[int, ...]:
    """The outlier channels of a point: a seeded choice, the same for every way of a shape."""
    n = max(1, min(OUTLIER_CHANNELS, E // 8))
    gen = torch.Generator().manual_seed(seed + 2)
    return tuple(sorted(int(c) for c in torch.randperm(E, generator=gen)[:n]))


# nn.MultiheadAttention's mask rules: a bool mask's True means "may not attend" (the opposite of
# SDPA's bool convention); a float mask is added to the scores; ``attn_mask`` is (L, S) or
# (B*H, L, S) and ``key_padding_mask`` (B, S). Here for the logits of the activation scale, and
# for every variant and kernel (variants/masks.py re-exports ``merge_masks``).


def merge_masks(
    attn_mask: torch.Tensor | None,
    key_padding_mask: torch.Tensor | None,
    B: int,
    H: int,
    L: int,
    S: int,
    dtype: torch.dtype,
) -> torch.Tensor | None:
    """One additive float mask broadcastable to (B, H, L, S), with nn.MultiheadAttention's rules.

    nn.MHA converts bool masks to float (True -> -inf) and adds both masks, so do we.
    """
    mask = None
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            attn_mask = torch.zeros_like(attn_mask, dtype=dtype).masked_fill(
                attn_mask, float("-inf")
            )
        attn_mask = attn_mask.to(dtype)
        if attn_mask.dim() == 2:  # (L, S)
            mask = attn_mask.view(1, 1, L, S)
        else:  # (B*H, L, S) -> (B, H, L, S)
            mask = attn_mask.view(B, H, L, S)
    if key_padding_mask is not None:
        if key_padding_mask.dtype == torch.bool:
            key_padding_mask = torch.zeros_like(key_padding_mask, dtype=dtype).masked_fill(
                key_padding_mask, float("-inf")
            )
        kpm = key_padding_mask.to(dtype).view(B, 1, 1, S)  # (B, S) -> (B, 1, 1, S)
        mask = kpm if mask is None else mask + kpm
    return mask


def calls(inputs: Inputs):
    """What nn.MHA computes logits for in the point's calls: (queries (B, L, E), keys (B, S, E),
    forward kwargs with the masks); a decode point's two steps against the whole sequence."""
    step = inputs
    while step is not None:
        key = step.key if step.prefix is None else torch.cat([step.prefix, step.query], dim=1)
        yield step.query, key, step.kwargs
        step = step.then


class Logits:
    """nn.MHA's largest logit that a softmax sees (the masks' hidden ones left out) as a function
    of the outlier factor, on sampled query rows.

    With the outlier channels multiplied by c, each projection is p0 + (c - 1) p1 (p0 the
    point's own, p1 the outlier channels' part), so a logit is a quadratic in t = c - 1: its
    three coefficient matrices are computed once and every factor tried is elementwise.

    Computed where ``mha``'s weights are (the CPU, or the GPU that runs a CUDA point's oracle).
    ``rows``: the query rows the check compares (harness/way/compared.py; None: every row), among
    which the logits are sampled."""

    def __init__(
        self,
        mha: nn.MultiheadAttention,
        inputs: Inputs,
        chans: tuple[int, ...],
        rows: torch.Tensor | None = None,
    ):
        self.parts = []  # (a, b, c) per call, each (B, H, rows, S)
        for query, key, kwargs in calls(inputs):
            self.parts.append(self._coefficients(mha, query, key, kwargs, chans, rows))
            rows = None  # a sample is the first call's rows (decode points have none)

    @staticmethod
    def _coefficients(mha, query, key, kwargs, chans, among=None):
        E, H = mha.embed_dim, mha.num_heads
        D = E // H
        device = mha.in_proj_weight.device
        queries = query.detach().to(device, torch.float64)
        keys = key.detach().to(device, torch.float64)
        B, L, S = queries.size(0), queries.size(1), keys.size(1)
        hidden = merge_masks(
            kwargs.get("attn_mask"), kwargs.get("key_padding_mask"), B, H, L, S, torch.float64
        )  # additive, broadcastable to (B, H, L, S), or None
        if hidden is not None:
            hidden = hidden.to(device)
        rows = torch.arange(L) if among is None else among.cpu()
        fit = max(1, MAX_LOGITS // (B * H * S))
        if len(rows) > fit:  # evenly spread rows, the last one included
            rows = rows[torch.linspace(0, len(rows) - 1, fit).round().long().unique()]
        rows = rows.to(device)
        if len(rows) < L:
            queries = queries[:, rows]
        w = mha.in_proj_weight.detach().double()
        b = mha.in_proj_bias.detach().double() if mha.in_proj_bias is not None else None
        wq, wk = w[:E], w[E : 2 * E]
        bq, bk = (None, None) if b is None else (b[:E], b[E : 2 * E])
        only = list(chans)

        def heads(x, weight, bias, outliers):  # (B, T, E) -> (B, H, T, D)
            if outliers:  # the outlier channels' part alone: (B, T, m) @ (m, E)
                y = x[..., only] @ weight[:, only].T
            else:
                y = x @ weight.T if bias is None else x @ weight.T + bias
            return y.reshape(x.size(0), x.size(1), H, D).transpose(1, 2)

        q0, q1 = heads(queries, wq, bq, False), heads(queries, wq, bq, True)
        k0, k1 = heads(keys, wk, bk, False), heads(keys, wk, bk, True)
        for step in (*getattr(mha, "steps", ()), getattr(mha, "projection", None)):
            if step is not None and not getattr(step, "linear", True):
                raise Unreachable(step.unreachable)
        if getattr(mha, "steps", None):  # turned at their positions (harness/way/transformed.py):
            qpos, kpos = torch.arange(S - L, S)[rows.cpu()], torch.arange(S)  # linear, so the
            q0, k0, _ = mha.transform(q0, k0, None, qpos, kpos)  # two parts turn apart
            q1, k1, _ = mha.transform(q1, k1, None, qpos, kpos)
        root = math.sqrt(D)
        a = q0 @ k0.transpose(-2, -1) / root  # (B, H, rows, S)
        if hidden is not None:  # -inf where the masks hide a key: it never reaches a softmax
            a = a + hidden.expand(B, H, L, S)[:, :, rows]
        lin = (q0 @ k1.transpose(-2, -1) + q1 @ k0.transpose(-2, -1)) / root
        return a, lin, q1 @ k1.transpose(-2, -1) / root

    # False: the largest logit; True: the largest in magnitude (where no factor makes any logit
    # large and positive: every outlier-outlier term is negative, as with one key and one head)
    magnitude = False

    @property
    def quadratic_max(self) -> float:
        """The largest coefficient of t^2 (what dominates at large factors)."""
        if self.magnitude:
            return max(c.abs().max().item() for _, _, c in self.parts)
        return max(c.max().item() for _, _, c in self.parts)

    def __call__(self, factor: float) -> float:
        t = factor - 1.0
        found = []
        for a, b, c in self.parts:
            v = a + t * b + t * t * c
            if self.magnitude:  # hidden keys (-inf) stay out
                v = torch.where(torch.isinf(v), v, v.abs())
            found.append(v.max().item())
        return max(found)


class Unreachable(ValueError):
    """No outlier factor reaches the target at this point: the pass cannot run (not the
    variant's failure)."""


def find_scale(
    mha: nn.MultiheadAttention,
    inputs: Inputs,
    target: float,
    seed: int,
    rows: torch.Tensor | None = None,
) -> Scale:
    """The outlier factor at which nn.MHA's largest logit is ``target`` (to 1%, rounded to 3
    significant digits); where no factor makes a logit large and positive, its largest in
    magnitude. Where the point's own logits already reach it the factor is 1. ``rows``: the
    query rows the check compares (None: every row), over which the largest logit is taken."""
    chans = channels(mha.embed_dim, seed)
    logits = Logits(mha, inputs, chans, rows)
    if logits(1.0) >= target:
        return Scale(chans, 1.0, logits(1.0))
    logits.magnitude = logits.quadratic_max <= 0
    # For a large factor the outlier part dominates, max logit ~ (factor - 1)^2 max c: start
    # from there and correct by that law (two to four evaluations), else bracket and bisect
    factor = 1.0 + math.sqrt(target / max(logits.quadratic_max, 1e-300))
    for _ in range(8):
        if factor > LARGEST:
            break
        reached = logits(factor)
        if abs(reached / target - 1) < PRECISION / 2:
            return rounded(logits, chans, factor)
        factor = 1.0 + (factor - 1.0) * (math.sqrt(target / reached) if reached > 0 else 2.0)
    low, high = 1.0, 2.0
    while logits(high) < target:
        if high >= LARGEST:
            raise Unreachable(
                f"no outlier factor up to {LARGEST:g} makes a logit reach check_max_logit="
                f"{target:g} at this point"
            )
        low, high = high, min(high * 2, LARGEST)
    while high - low > PRECISION * low / 2:
        mid = (low + high) / 2
        low, high = (mid, high) if logits(mid) < target else (low, mid)
    return rounded(logits, chans, high)


def rounded(logits: Logits, chans: tuple[int, ...], factor: float) -> Scale:
    """The scale at ``factor`` rounded to 3 significant digits: the same inputs on every device
    and dtype."""
    factor = float(f"{factor:.3g}")
    return Scale(chans, factor, logits(factor), not logits.magnitude)
