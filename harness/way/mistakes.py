"""The known mistakes of hand-written attention, each nn.MultiheadAttention's math with one step
done wrong (docs/reference.md, "Known mistakes"; how a module is matched with them:
``harness.way.diagnose``).

Each is one function registered with ``@mistake(step, says, fix, applies)`` (harness/way/
steps.py: the steps, their signatures and ``Math``, which runs them): it replaces that step of
nn.MHA's math and nothing else. Adding a mistake is one such function, here (a model feature's:
``@FEATURE.mistake`` in its module, harness/features/); the reference page (``make docs``) and
the diagnosis follow.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from harness import features
from harness.way.steps import (
    CATALOGUE,
    DOCS,
    Math,
    Mistake,
    Weights,
    mask,
    mistake,
    project,
    weights,
)
from harness.config import Point
from harness.way.calls import additive

__all__ = ["CATALOGUE", "DOCS", "Math", "Mistake", "by_name"]


# ------------------------------------------------------------------- the mistakes, by step
# Each is the right step above with one thing changed; ``applies`` leaves out the points where
# it cannot show (a mistake that computes the right thing at a point is also left out there,
# whatever ``applies`` says: harness/way/diagnose.py).


def _grouped(p: Point) -> bool:
    return p.groups > 1


def _fused_layout(p: Point) -> bool:  # one (3E, E) weight read whole: no grouped K/V heads
    return p.groups == 1


def _reordered(order: str):
    def fn(m) -> Weights:
        w = weights(m)
        parts = {"q": (w.q, w.bq), "k": (w.k, w.bk), "v": (w.v, w.bv)}
        (q, bq), (k, bk), (v, bv) = (parts[c] for c in order)
        return Weights(q, k, v, bq, bk, bv, w.o, w.bo)

    return fn


for _order in ("".join(p) for p in itertools.permutations("qkv")):
    if _order != "qkv":
        mistake(
            "weights",
            f"the fused weight's three chunks taken as {', '.join(_order)}, not q, k, v",
            "nn.MHA's in_proj_weight rows are [Wq; Wk; Wv]: chunk(3) gives q, k, v in that order",
            _fused_layout,
            name=f"fused_chunks_{_order}",
        )(_reordered(_order))


def _rows(t: torch.Tensor | None, order: str, H: int) -> torch.Tensor | None:
    """nn.MHA's (3E, ...) rows regrouped: ``per_head`` reads them as (H, 3, D) where they are
    (3, H, D); ``per_role`` the reverse (what converting to a per-head layout does)."""
    if t is None:
        return None
    rest = t.shape[1:]
    if order == "per_head":  # rows taken as [q_h; k_h; v_h] per head
        return t.view(H, 3, -1, *rest).transpose(0, 1).reshape(t.shape)
    return t.view(3, H, -1, *rest).transpose(0, 1).reshape(t.shape)


def _relaid(order: str):
    def fn(m) -> Weights:
        W, b = _rows(m.in_proj_weight, order, m.H), _rows(m.in_proj_bias, order, m.H)
        q, k, v = W.chunk(3)
        bq, bk, bv = (None,) * 3 if b is None else b.chunk(3)
        return Weights(q, k, v, bq, bk, bv, m.out_proj.weight, m.out_proj.bias)

    return fn


mistake(
    "weights",
    "the fused weight read per head, as (H, 3, D) rows, where nn.MHA's are (3, H, D)",
    "permute the rows when loading a per-head packed layout: "
    "W.view(3, H, D, E).transpose(0, 1).reshape(3 * E, E)",
    _fused_layout,
    name="fused_read_per_head",
)(_relaid("per_head"))
mistake(
    "weights",
    "the fused weight's rows permuted per head ((3, H, D) to (H, 3, D)) for a module that "
    "reads them as nn.MHA's (3, H, D)",
    "read nn.MHA's in_proj_weight as it is when the module splits it as q, k, v chunks",
    _fused_layout,
    name="fused_permuted_per_head",
)(_relaid("per_role"))


@mistake(
    "weights",
    "the keys and values projected with the query's weights",
    "project the key with Wk (rows E:2E) and the value with Wv (rows 2E:3E)",
)
def kv_with_query_weights(m) -> Weights:
    w = weights(m)
    return w._replace(k=w.q, v=w.q, bk=w.bq, bv=w.bq)


@mistake(
    "weights",
    "no biases (in_proj_bias and out_proj.bias dropped)",
    "give the projections bias=True and load in_proj_bias and out_proj.bias",
    lambda p: p.in_bias and p.out_bias,
)
def biases_dropped(m) -> Weights:
    return weights(m)._replace(bq=None, bk=None, bv=None, bo=None)


@mistake(
    "weights",
    "no q, k, v biases (in_proj_bias dropped)",
    "give the q, k, v projections bias=True and load in_proj_bias's three chunks",
    lambda p: p.in_bias,
)
def in_biases_dropped(m) -> Weights:
    return weights(m)._replace(bq=None, bk=None, bv=None)


@mistake(
    "weights",
    "no output bias (out_proj.bias dropped)",
    "give the output projection bias=True and load out_proj.bias",
    lambda p: p.out_bias,
)
def out_bias_dropped(m) -> Weights:
    return weights(m)._replace(bo=None)


@mistake(
    "weights",
    "grouped K/V heads tiled (query head h reads K/V head h % Hkv, `repeat`) where they "
    "repeat per group (h // G, `repeat_interleave`)",
    "expand K/V heads with repeat_interleave(G, dim=1) (or SDPA's enable_gqa), not repeat",
    _grouped,
)
def gqa_tiled(m) -> Weights:
    w = weights(m)
    Hkv = m.H // m.G
    # nn.MHA's K/V rows hold each group's head G times (harness/way/inputs.py, tie_groups): head h
    # of the tiled module reads group h % Hkv, i.e. nn.MHA's head (h % Hkv) * G
    heads = torch.tensor([(h % Hkv) * m.G for h in range(m.H)], device=w.k.device)

    def tiled(t):
        return None if t is None else t.view(m.H, m.D, *t.shape[1:])[heads].reshape(t.shape)

    return w._replace(k=tiled(w.k), v=tiled(w.v), bk=tiled(w.bk), bv=tiled(w.bv))


@mistake(
    "weights",
    "grouped K/V weights read as the first Hkv heads' rows of nn.MHA's K/V projection, where "
    "K/V head j is every G-th head (nn.MHA's rows repeat each group's head G times)",
    "load K/V head j from nn.MHA's head j * G (its rows j*G*D .. j*G*D + D), not rows j*D ..",
    _grouped,
)
def gqa_first_heads(m) -> Weights:
    w = weights(m)
    # the module's K/V head j holds nn.MHA's head j (a head of group j // G): query head h, in
    # group h // G, reads it; nn.MHA's head h // G
    heads = torch.tensor([h // m.G for h in range(m.H)], device=w.k.device)

    def first(t):
        return None if t is None else t.view(m.H, m.D, *t.shape[1:])[heads].reshape(t.shape)

    return w._replace(k=first(w.k), v=first(w.v), bk=first(w.bk), bv=first(w.bv))


@mistake(
    "project",
    "the in-projection weights used untransposed (x @ W, not x @ W.T)",
    "F.linear(x, W, b) or x @ W.T + b: nn.MHA's weights are (out, in) as nn.Linear's",
)
def in_weights_untransposed(m, query, key, value, w: Weights):
    return tuple(
        x @ W + (0 if b is None else b)
        for x, W, b in ((query, w.q, w.bq), (key, w.k, w.bk), (value, w.v, w.bv))
    )


@mistake(
    "project",
    "the key and value inputs swapped (keys projected from the value, values from the key)",
    "call attention(query, key, value) in that order; nn.MHA's forward is (query, key, value)",
    lambda p: p.cross,
)
def key_value_swapped(m, query, key, value, w: Weights):
    return F.linear(query, w.q, w.bq), F.linear(value, w.k, w.bk), F.linear(key, w.v, w.bv)


@mistake(
    "project",
    "the key path detached (no gradient through the keys)",
    "remove the .detach() (or torch.no_grad()) around the key projection",
    lambda p: p.mode == "fwd_bwd",
)
def key_detached(m, query, key, value, w: Weights):
    q, k, v = project(m, query, key, value, w)
    return q, k.detach(), v


@mistake(
    "project",
    "the value path detached (no gradient through the values)",
    "remove the .detach() (or torch.no_grad()) around the value projection",
    lambda p: p.mode == "fwd_bwd",
)
def value_detached(m, query, key, value, w: Weights):
    q, k, v = project(m, query, key, value, w)
    return q, k, v.detach()


@mistake(
    "split",
    "the heads split without the permute (x.view(B, H, T, D) straight from (B, T, E))",
    "x.view(B, T, H, D).transpose(1, 2)",
)
def heads_split_without_permute(m, x):
    B, T, _ = x.shape
    return x.reshape(B, m.H, T, m.D)


@mistake(
    "scale",
    "the scores scaled by 1/sqrt(embed_dim), not 1/sqrt(head_dim)",
    "scale by head_dim ** -0.5, head_dim = embed_dim // num_heads",
)
def scale_sqrt_embed_dim(m) -> float:
    return m.E**-0.5


@mistake("scale", "the scores not scaled", "multiply q . k by head_dim ** -0.5 before the softmax")
def scale_missing(m) -> float:
    return 1.0


@mistake(
    "scale",
    "the scale applied twice (1/head_dim)",
    "scale once: SDPA scales by itself, so q must not be pre-scaled for it",
)
def scale_twice(m) -> float:
    return 1.0 / m.D


def _has(*names):
    def applies(p: Point) -> bool:
        masks = {
            # every mask but none and padding is an attn_mask (causal, a window, a feature's)
            "attn_mask": p.mask not in ("none", "padding") or p.kv_cache_len is not None,
            "key_padding_mask": p.mask == "padding",
            "bool": p.mask_format == "bool",
            "decode": p.kv_cache_len is not None,
        }
        return all(masks[n] for n in names)

    return applies


@mistake(
    "mask",
    "the masks ignored (computed and thrown away, e.g. masked_fill without assigning it)",
    "scores = scores.masked_fill(mask, float('-inf')) (masked_fill is not in place) or pass it",
    lambda p: _has("attn_mask")(p) or _has("key_padding_mask")(p),
)
def masks_ignored(m, attn_mask, key_padding_mask, L, S):
    return None


@mistake(
    "mask",
    "attn_mask ignored (key_padding_mask applied)",
    "apply attn_mask too: both masks add up",
    _has("attn_mask", "key_padding_mask"),
)
def attn_mask_ignored(m, attn_mask, key_padding_mask, L, S):
    return mask(m, None, key_padding_mask, L, S)


@mistake(
    "mask",
    "key_padding_mask ignored (attn_mask applied)",
    "apply key_padding_mask too, broadcast as (B, 1, 1, S)",
    _has("attn_mask", "key_padding_mask"),
)
def padding_mask_ignored(m, attn_mask, key_padding_mask, L, S):
    return mask(m, attn_mask, None, L, S)


@mistake(
    "mask",
    "attn_mask inverted (a bool True read as 'may attend', SDPA's convention; nn.MHA's True "
    "means 'may not attend')",
    "invert nn.MHA's bool mask before F.scaled_dot_product_attention or a mask_mod: ~attn_mask",
    _has("attn_mask", "bool"),
)
def attn_mask_inverted(m, attn_mask, key_padding_mask, L, S):
    return mask(m, None if attn_mask is None else ~attn_mask, key_padding_mask, L, S)


@mistake(
    "mask",
    "key_padding_mask inverted (True read as 'may attend'; nn.MHA's True means padded)",
    "invert nn.MHA's bool key_padding_mask before SDPA or a mask_mod: ~key_padding_mask",
    _has("key_padding_mask", "bool"),
)
def padding_mask_inverted(m, attn_mask, key_padding_mask, L, S):
    flipped = None if key_padding_mask is None else ~key_padding_mask
    return mask(m, attn_mask, flipped, L, S)


@mistake(
    "mask",
    "key_padding_mask applied to the queries ((B, 1, S, 1) where it is (B, 1, 1, S))",
    "key_padding_mask.view(B, 1, 1, S): it hides keys, not queries",
    lambda p: _has("key_padding_mask")(p) and p.seq_len == p.kv_seq_len,
)
def padding_mask_on_queries(m, attn_mask, key_padding_mask, L, S):
    a = mask(m, attn_mask, None, L, S)
    k = additive(key_padding_mask).view(-1, 1, S, 1)  # over the queries (L == S)
    return k if a is None else a + k


def _causal(L: int, S: int, aligned: str, window: int | None, device) -> torch.Tensor:
    """(L, S) bool, True = may not attend; queries at the top (positions 0..L-1) or at the
    bottom (the last L of S, nn.MHA's decode) of the keys; a window of ``window`` keys."""
    first = 0 if aligned == "top" else S - L
    position = torch.arange(first, first + L, device=device).unsqueeze(1)  # (L, 1)
    keys = torch.arange(S, device=device).unsqueeze(0)  # (1, S)
    hidden = keys > position
    if window is not None:
        hidden |= keys <= position - window
    return hidden


@mistake(
    "mask",
    "the causal mask aligned top-left (query i sees keys 0..i) where nn.MHA's decode step is "
    "aligned bottom-right (the new tokens follow the cache)",
    "the L new tokens are the last L of S positions: hide keys > (S - L + i), "
    "not SDPA's is_causal=True",
    _has("decode"),
)
def causal_top_left(m, attn_mask, key_padding_mask, L, S):
    hidden = _causal(L, S, "top", m.point.window, m.device)
    return mask(m, hidden, key_padding_mask, L, S)


@mistake(
    "mask",
    "the causal mask aligned bottom-right (the queries as the last L of S) where nn.MHA "
    "aligns it top-left",
    "nn.MHA's causal attn_mask is the one given (triu(1) of (L, S)): apply it as it is",
    lambda p: p.mask == "causal" and p.kv_cache_len is None and p.seq_len != p.kv_seq_len,
)
def causal_bottom_right(m, attn_mask, key_padding_mask, L, S):
    hidden = _causal(L, S, "bottom", None, m.device)
    return mask(m, hidden, key_padding_mask, L, S)


@mistake(
    "mask",
    "a causal mask applied though none was given (no mask read as causal, a decoder library's "
    "default)",
    "apply a causal mask only when one is passed (attn_mask, or is_causal=True): nn.MHA without "
    "a mask lets every query see every key",
    lambda p: p.mask in ("none", "padding") and p.kv_cache_len is None and p.seq_len > 1,
)
def causal_without_mask(m, attn_mask, key_padding_mask, L, S):
    return mask(m, _causal(L, S, "top", None, m.device), key_padding_mask, L, S)


@mistake(
    "mask",
    "the decode step attending to the cache before writing its own keys (the new tokens do "
    "not see themselves)",
    "write the step's keys and values into the cache first, then attend to all P + L of them",
    _has("decode"),
)
def cache_before_own_keys(m, attn_mask, key_padding_mask, L, S):
    own = torch.zeros(L, S, dtype=torch.bool, device=m.device)
    own[:, S - L :] = True  # the step's own L keys, hidden from every new token
    right = mask(m, attn_mask, key_padding_mask, L, S)
    hidden = additive(own).view(1, 1, L, S)
    return hidden if right is None else right + hidden


@mistake(
    "softmax",
    "the softmax over the queries (dim=-2), not the keys",
    "torch.softmax(scores, dim=-1)",
)
def softmax_query_axis(m, scores):
    return torch.softmax(scores, dim=-2)


@mistake(
    "merge",
    "the heads merged without the permute ((B, H, L, D) reshaped straight to (B, L, E))",
    "o.transpose(1, 2).reshape(B, L, E): move H back next to D first",
)
def heads_merged_without_permute(m, o):
    B, H, L, D = o.shape
    return o.reshape(B, L, H * D)


@mistake(
    "project_out",
    "the output projection skipped",
    "apply out_proj (out_proj.weight, out_proj.bias) to the merged heads",
)
def out_proj_skipped(m, x, w: Weights):
    return x


@mistake(
    "project_out",
    "the output projection's weight used untransposed (x @ Wo, not x @ Wo.T)",
    "F.linear(x, out_proj.weight, out_proj.bias)",
)
def out_weight_untransposed(m, x, w: Weights):
    return x @ w.o + (0 if w.bo is None else w.bo)


def by_name() -> dict[str, Mistake]:
    return {m.name: m for m in CATALOGUE}


# A module that skips a step computes something, and the diagnosis names what it skipped (the
# other omissions sit with their step's mistakes above). A skipped softmax is not among them: its
# unnormalised weights are orders of magnitude off, and in bfloat16 their own rounding is past any
# tolerance, so it could not be told apart reliably.
@mistake(
    "project",
    "the input projections skipped (the query, key and value used as they came)",
    "project them first: q, k, v = F.linear(x, W_q, b_q), ... (nn.MHA's in_proj_weight rows)",
)
def in_proj_skipped(m, query, key, value, w: Weights):
    return query, key, value


CATALOGUE.extend(features.mistakes())  # each model feature's, after the core steps'

