"""A point's seeded reference module and inputs (harness/way/calls.py's ``Inputs``).

Same seed, same weights, same inputs: everything is drawn on the CPU from a private generator
in float64, then cast and moved, so a point is reproducible across devices and dtypes.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from harness import features
from harness.config import Point
from harness.way.calls import Inputs
from harness.way.transformed import Transformed
from harness.way.calls import additive


# nn.MultiheadAttention zero-initialises both biases; a zero bias hides every bias bug
# (dropped, applied twice, applied to the wrong projection), so they are redrawn at this scale.
BIAS_STD = 0.2


def tie_groups(weight: torch.Tensor, E: int, H: int, G: int) -> None:
    """Grouped-query attention as nn.MHA: in nn.MHA's [Wq; Wk; Wv] rows (3E, ...) each group of G
    K/V heads is made a copy of its first head (query head h uses K/V head h // G), in place."""
    D = E // H
    for part in (weight[E : 2 * E], weight[2 * E :]):  # K rows, V rows: (E, ...)
        heads = part.view(H // G, G, D, *part.shape[1:])  # (Hkv, G, D, ...)
        heads.copy_(heads[:, :1].expand_as(heads).clone())


def make_reference(point: Point) -> nn.MultiheadAttention:
    """A float64 CPU nn.MultiheadAttention with seeded weights and non-zero biases (those a
    ``bias`` layout leaves out are zero: ``comparable`` drops their gradients). With
    num_kv_heads < num_heads, the grouped-query model's weights as nn.MHA's: each K/V head
    repeated for its group (``tie_groups``), the same math as the grouped module. Each model
    feature of the point then makes it express the feature (harness/features/: a zero key, a
    parameter)."""
    gen = torch.Generator().manual_seed(point.seed)
    biased = point.bias is not False  # nn.MHA's one flag; a layout zeroes the others below
    active = features.active(point)
    turning = [f for f in active if any(h in ("qk", "project") for h, _ in f.steps.values())]
    steps = [fn for f in turning for hook, fn in f.steps.values() if hook == "qk"]
    projection = next((fn for f in turning for h, fn in f.steps.values() if h == "project"), None)
    if turning:  # a feature between the projections and the scores (rotary), or a projection of
        # its own (latent attention): nn.MHA fed what they make
        arguments = {k: v for f in turning for k, v in f.argument(point).items()}
        ref = Transformed(
            point.embed_dim, point.num_heads, biased, steps, projection, **arguments
        )
    else:
        ref = nn.MultiheadAttention(point.embed_dim, point.num_heads, bias=biased, batch_first=True)
    ref = ref.double().eval()
    with torch.no_grad():
        for (
            p
        ) in ref.parameters():  # redraw nn.MHA's own init so the weights depend on the seed only
            # weights: unit-variance outputs
            scale = BIAS_STD if p.dim() == 1 else p.shape[-1] ** -0.5
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * scale)
        if biased and not point.in_bias:  # bias=out: no query, key or value biases
            ref.in_proj_bias.zero_()
        if biased and not point.out_bias:  # bias=qkv (Qwen2): no output bias
            ref.out_proj.bias.zero_()
        if point.groups > 1:
            tie_groups(ref.in_proj_weight, point.embed_dim, point.num_heads, point.groups)
            if ref.in_proj_bias is not None:
                tie_groups(ref.in_proj_bias, point.embed_dim, point.num_heads, point.groups)
    for feature in active:  # drawn last: the other weights stay as they were
        feature.reference(point, ref, gen)
    return ref


def padding_mask(B: int, S: int, left: int = 0) -> torch.Tensor:
    """(B, S) bool, True = padded: batch row b pads its last 1 + b*S // (2B) keys, never all of
    them (a fully masked row has no softmax: nn.MHA returns NaN there), none when S == 1. With
    ``left`` = P (decode after a batch of prompts of P positions): the prompts are left-padded,
    row b pads its first b*P // B positions (row 0 is the longest prompt), the new tokens never."""
    mask = torch.zeros(B, S, dtype=torch.bool)
    for b in range(B):
        if left:
            mask[b, : min(left - 1, b * left // B)] = True
            continue
        n_pad = min(S - 1, 1 + b * S // (2 * B))
        if n_pad > 0:
            mask[b, S - n_pad :] = True
    return mask


def not_seen(L: int, S: int) -> torch.Tensor | None:
    """(L, S) bool, True = may not attend (nn.MHA's convention), for L queries that are the last
    L of the S positions (a decode step after S - L cached ones): causal. None when every query
    sees every key (one new token against its cache)."""
    position = torch.arange(S - L, S).unsqueeze(1)  # (L, 1): each query's place in the sequence
    hidden = torch.arange(S).unsqueeze(0) > position  # (L, S)
    return hidden if hidden.any() else None


def call_kwargs(point: Point, L: int, S: int) -> dict:
    """forward()'s masks and flags for L queries against S keys (a decode step: the last L of S)."""
    kwargs: dict = {"need_weights": point.need_weights}
    if point.need_weights:
        kwargs["average_attn_weights"] = point.average_attn_weights
    decode = point.kv_cache_len is not None
    if decode:
        # The new tokens follow the cache (bottom-right aligned): an explicit mask, no
        # is_causal hint (the hint means top-left causal, nothing more).
        hidden = not_seen(L, S)  # (L, S) or None
        if hidden is not None:
            kwargs["attn_mask"] = hidden
    elif point.mask == "causal":
        # nn.MHA wants the explicit mask *and* the hint; True = may not attend. Top-left aligned
        # when S != L, as F.scaled_dot_product_attention(is_causal=True) is.
        kwargs["attn_mask"] = torch.ones(L, S, dtype=torch.bool).triu(1)  # (L, S)
        kwargs["is_causal"] = True
    for feature in features.active(point):  # a mask of its own (a window), no hint
        hidden = feature.attn_mask(point, L, S)
        if hidden is not None:
            kwargs["attn_mask"] = hidden  # (L, S)
    if point.mask == "padding":  # decode: left-padded prompts in the cache
        kwargs["key_padding_mask"] = padding_mask(point.batch, S, point.kv_cache_len or 0)  # (B, S)
    if point.mask_format == "additive":
        for k in ("attn_mask", "key_padding_mask"):
            if k in kwargs:
                kwargs[k] = additive(kwargs[k])  # float64 0 / -inf
    return kwargs


def make_inputs(point: Point) -> Inputs:
    """Float64 CPU inputs for the point; call ``.to(device, dtype)`` for the point's own."""
    gen = torch.Generator().manual_seed(point.seed + 1)
    B, L, S, E = point.batch, point.seq_len, point.kv_seq_len, point.embed_dim
    query = torch.randn(B, L, E, generator=gen, dtype=torch.float64)
    prefix = None
    if point.kv_cache_len is not None:  # decode: the cached tokens come before the new ones
        prefix = torch.randn(B, point.kv_cache_len, E, generator=gen, dtype=torch.float64)
    if point.cross:
        key = torch.randn(B, S, E, generator=gen, dtype=torch.float64)
        value = torch.randn(B, S, E, generator=gen, dtype=torch.float64)
        value = key if point.shared_kv else value  # drawn anyway: later draws stay as they were
    else:
        key = value = query
    grad_out = torch.randn(B, L, E, generator=gen, dtype=torch.float64)
    cache = {}  # what a feature's KV cache is made with: its own seeds, the draws stay the same
    if prefix is not None:
        for feature in features.active(point):
            cache.update(feature.cache_kwargs(point))
    then = None
    if prefix is not None:  # drawn last: the first step's tensors are as they always were
        nxt = torch.randn(B, L, E, generator=gen, dtype=torch.float64)
        then = Inputs(
            nxt,
            nxt,
            nxt,
            call_kwargs(point, L, S + L),
            grad_out,
            torch.cat([prefix, query], dim=1),  # (B, P + L, E): what the second step follows
            point.kv_cache,
            point=point,
        )
    return Inputs(
        query, key, value, call_kwargs(point, L, S), grad_out, prefix, point.kv_cache, then, point,
        cache_kwargs=cache,
    )  # fmt: skip
