"""One real mistake each, from people's hand-written MHA . Each class is the
textbook implementation with a single step done wrong."""

import math

import torch
from textbook import Textbook

from variants.cache import ConcatCache, StaticCache
from variants.packed import PackedHeadsMHA
from variants.separate import SeparateProjMHA


class NoPermute(Textbook):
    """Heads merged straight from (B, H, L, D) to (B, L, E) without moving H back next to D."""

    def merge(self, out):
        B, H, L, D = out.shape
        return out.reshape(B, L, H * D)


class SqrtEmbedDim(Textbook):
    """Scores scaled by 1/sqrt(embed_dim) instead of 1/sqrt(head_dim)."""

    def scale(self):
        return 1.0 / math.sqrt(self.E)


class KVWithQueryWeights(Textbook):
    """Keys and values projected with the query's weights."""

    def project(self, query, key, value):
        return self.q_proj(query), self.q_proj(key), self.q_proj(value)


class MaskNotApplied(Textbook):
    """masked_fill is not in place: the masked scores are computed and thrown away."""

    def apply_mask(self, scores, mask):
        scores.masked_fill(torch.isinf(mask), float("-inf"))
        return scores


class SoftmaxWrongAxis(Textbook):
    """Softmax over the queries (dim=-2) instead of the keys."""

    def softmax(self, scores):
        return torch.softmax(scores, dim=-2)


class BiasDropped(Textbook):
    """Projections built without bias, and nn.MHA's biases silently discarded on load."""

    def __init__(self, embed_dim, num_heads, bias=True):
        super().__init__(embed_dim, num_heads, bias=False)

    def load_hook(self, sd, prefix, *args):
        sd.pop(prefix + "in_proj_bias", None)
        sd.pop(prefix + "out_proj.bias", None)
        super().load_hook(sd, prefix, *args)


class KeyDetached(Textbook):
    """The key projection's output detached: forward is right, no gradient reaches k_proj."""

    def project(self, query, key, value):
        return self.q_proj(query), self.k_proj(key).detach(), self.v_proj(value)


class PackedUnpermuted(PackedHeadsMHA):
    """Packed (B, L, H, 3*D) heads loaded with nn.MHA's [Wq; Wk; Wv] rows as they are."""

    def to_packed(self, t):
        return t


# The attention models ship today: each mistake below passes every prefill check without its
# feature and must fail with it.


class GQATiled(SeparateProjMHA):
    """Grouped-query K/V heads tiled (head h gets K/V head h % Hkv, ``repeat``) where they must
    repeat per group (h // G, ``repeat_interleave``): the weights' grouping is lost."""

    def repeat_kv(self, x):
        return x.repeat(1, self.groups, 1, 1)  # (B, Hkv, S, D) -> (B, H, S, D), tiled


class OneOffCache(StaticCache):
    """Writes the new keys one slot early, over the last cached token (the 0-based position of
    the last token taken for the length), and reads the right number of slots: the last is
    never written."""

    def update(self, k, v):
        start = max(self.length - 1, 0)
        self.k[:, :, start : start + k.size(2)] = k
        self.v[:, :, start : start + k.size(2)] = v
        self.pending = end = self.length + k.size(2)
        return self.k[:, :, :end], self.v[:, :, :end]


class CacheOneOff(SeparateProjMHA):
    """A static KV cache read (and written) one position off."""

    def new_cache(self, style, batch, capacity, device, dtype):
        return OneOffCache(batch, self.num_kv_heads, capacity, self.head_dim, device, dtype)


class OwnWindow(SeparateProjMHA):
    """Builds its sliding-window mask itself from a ``window`` option, as models do from their
    config, in place of the one it is given; ``wider`` keys more than the window."""

    wider = 0

    def __init__(self, *args, window: int = 4, **kwargs):
        super().__init__(*args, **kwargs)
        self.window = window

    def forward(self, query, key, value, attn_mask=None, **kwargs):
        L = query.size(1)
        S = L + (kwargs["kv_cache"].length if kwargs.get("kv_cache") is not None else 0)
        position = torch.arange(S - L, S, device=query.device).unsqueeze(1)  # (L, 1)
        keys = torch.arange(S, device=query.device).unsqueeze(0)  # (1, S)
        hidden = (keys > position) | (keys <= position - self.window - self.wider)  # (L, S)
        kwargs.pop("is_causal", None)
        return super().forward(query, key, value, attn_mask=hidden, **kwargs)


class WindowOneWide(OwnWindow):
    """Each query sees one key more than the window: ``<`` written where ``<=`` belongs."""

    wider = 1


class KeepingCache(ConcatCache):
    """Commits every update, as transformers' DynamicCache does: each call appends its new keys
    and values for good. Right at the first call; every later call attends to a longer cache."""

    def update(self, k, v):
        self.k, self.v = torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)
        return self.k, self.v

    def advance(self):
        pass  # update has committed already


class CacheKept(SeparateProjMHA):
    """A committing cache and no rewind: timed while computing something else."""

    def new_cache(self, style, batch, capacity, device, dtype):
        return KeepingCache(batch, self.num_kv_heads, capacity, self.head_dim, device, dtype)


class RewoundCache(KeepingCache):
    """The correct twin of ``KeepingCache`` for timing: it commits, and ``rewind`` drops what
    was appended after the prefix (docs/adding.md, "The KV cache contract")."""

    prefix = 0

    def rewind(self):
        self.k, self.v = self.k[:, :, : self.prefix], self.v[:, :, : self.prefix]


class CacheRewound(SeparateProjMHA):
    def new_cache(self, style, batch, capacity, device, dtype):
        return RewoundCache(batch, self.num_kv_heads, capacity, self.head_dim, device, dtype)

    def fill_cache(self, kv_cache, x):
        super().fill_cache(kv_cache, x)
        kv_cache.prefix = kv_cache.length  # what rewind returns to


class PositionKept(SeparateProjMHA):
    """Keeps the position of its next token on the module, as models keep a rotary offset, and
    builds its causal mask from it; ``fill_cache`` sets it to P and each forward advances it by
    L. Right at every step of one generation (the check's two steps); a call repeated on the
    same cache (the timed calls) takes its queries for later tokens, and no rewind returns it."""

    position = start = 0  # a prefill starts at 0

    def fill_cache(self, kv_cache, x):
        super().fill_cache(kv_cache, x)
        self.position = self.start = x.size(1)

    def forward(self, query, key, value, attn_mask=None, **kwargs):
        L, cache = query.size(1), kwargs.get("kv_cache")
        S = L + (cache.length if cache is not None else 0)
        position = torch.arange(self.position, self.position + L, device=query.device)
        hidden = torch.arange(S, device=query.device).unsqueeze(0) > position.unsqueeze(1)
        self.position += L
        kwargs.pop("is_causal", None)
        return super().forward(query, key, value, attn_mask=hidden, **kwargs)


class PositionAsserted(PositionKept):
    """Asserts that its position is the cache's length, as models assert their cache position:
    true at each step of one generation, an empty ``AssertionError`` at a call repeated on the
    same cache."""

    def forward(self, query, key, value, attn_mask=None, **kwargs):
        cache = kwargs.get("kv_cache")
        assert cache is None or self.position == cache.length
        return super().forward(query, key, value, attn_mask=attn_mask, **kwargs)


class PositionRewound(PositionKept):
    """The correct twin: ``rewind`` returns the position to where ``fill_cache`` left it."""

    def rewind(self):
        self.position = self.start


class WholeBufferCache(StaticCache):
    """Returns its whole buffer, not the P + L tokens it holds: right only when the capacity is
    exactly P + L."""

    def update(self, k, v):
        super().update(k, v)
        return self.k, self.v


class CacheWholeBuffer(SeparateProjMHA):
    def new_cache(self, style, batch, capacity, device, dtype):
        return WholeBufferCache(batch, self.num_kv_heads, capacity, self.head_dim, device, dtype)


class EarlyCache(StaticCache):
    """Counts a step's tokens one short when it commits them (``advance``), so the next step writes
    its keys one slot early, over the last token of the step before: the first step after the
    prefix is right, any generation loop is wrong."""

    filled = False

    def advance(self):
        self.length = self.pending - (1 if self.filled else 0)
        self.filled = True


class CacheEarly(SeparateProjMHA):
    def new_cache(self, style, batch, capacity, device, dtype):
        return EarlyCache(batch, self.num_kv_heads, capacity, self.head_dim, device, dtype)


# Numerics: right at unit scale (logits below about 4), wrong once real activations push the
# logits to tens or hundreds. Each is caught by the activation-scale check only
# (docs/methodology.md, Two scales); ``StableSoftmax`` is the same code done right.


class UnstableSoftmax(Textbook):
    """Softmax written out as exp(s) / sum(exp(s)), the row max never subtracted: exp overflows
    past a logit of 88.7 (float32, bfloat16) or 11.1 (float16), and inf / inf is NaN."""

    def softmax(self, scores):
        e = scores.exp()
        return e / e.sum(dim=-1, keepdim=True)


class GlobalMaxSoftmax(Textbook):
    """Stabilised with the max of the whole tensor (``scores.max()``) instead of each row's: a
    row whose logits sit far below the largest one underflows to 0 / 0."""

    def softmax(self, scores):
        e = (scores - scores.max()).exp()
        return e / e.sum(dim=-1, keepdim=True)


class StableSoftmax(Textbook):
    """The control: the same written-out softmax with each row's max subtracted."""

    def softmax(self, scores):
        e = (scores - scores.amax(dim=-1, keepdim=True)).exp()
        return e / e.sum(dim=-1, keepdim=True)


class TwoMistakes(Textbook):
    """Two mistakes at once, each in the catalogue alone: the scores left unscaled and the heads
    merged without the permute. No single known mistake computes this; the diagnosis must say so
    rather than name one of the two."""

    def scale(self):
        return 1.0

    def merge(self, out):
        B, H, L, D = out.shape
        return out.reshape(B, L, H * D)


class OneHeadUnscaled(Textbook):
    """Head 2's scores left unscaled, the others right: a mistake in one head (an off-by-one in a
    per-head loop, say), which the localisation must find in that head alone."""

    def scale(self):
        scale = torch.full(
            (1, self.H, 1, 1), 1.0 / math.sqrt(self.D), dtype=self.q_proj.weight.dtype
        )
        scale[:, 2] = 1.0
        return scale


class HalfOutput(Textbook):
    """Returns half the embedding: the output's shape is wrong, which the error must say."""

    def forward(self, *args, **kwargs):
        out, weights = super().forward(*args, **kwargs)
        return out[..., : self.E // 2], weights


# Decode mistakes written independently of the catalogue (tests/test_diagnosis.py names each).


class ReadFirstCache(StaticCache):
    """Hands back what it held before writing the step's keys: the new tokens attend to the
    cache alone, not to themselves."""

    def update(self, k, v):
        held = self.k[:, :, : self.length].clone(), self.v[:, :, : self.length].clone()
        super().update(k, v)
        return held


class CacheReadFirst(SeparateProjMHA):
    def new_cache(self, style, batch, capacity, device, dtype):
        return ReadFirstCache(batch, self.num_kv_heads, capacity, self.head_dim, device, dtype)


class WindowOneNarrow(OwnWindow):
    """Each query sees one key fewer than the window: ``<=`` written for ``<``."""

    wider = -1


class DecodeTopLeft(SeparateProjMHA):
    """Decodes with SDPA's is_causal=True in place of the mask it is given: causal aligned
    top-left, so the new tokens see the first keys of the cache, not the sequence up to them."""

    def forward(self, query, key, value, attn_mask=None, **kwargs):
        kwargs["is_causal"] = True
        return super().forward(query, key, value, attn_mask=None, **kwargs)


class CausalUnmasked(Textbook):
    """No mask read as causal (a decoder library's default): given none, it hides the future."""

    def forward(self, query, key, value, key_padding_mask=None, need_weights=False,
                attn_mask=None, average_attn_weights=True, is_causal=False):  # fmt: skip
        if attn_mask is None:
            L, S = query.size(1), key.size(1)
            attn_mask = torch.ones(L, S, dtype=torch.bool, device=query.device).triu(1)
        return super().forward(
            query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights
        )


class SDPAMaskUninverted(Textbook):
    """nn.MHA's bool attn_mask (True: may not attend) handed to SDPA as it is (where True means
    may attend): causal becomes anti-causal, and the last query row, every key hidden, gets
    SDPA's zeros where a manual softmax gives NaN."""

    def forward(self, query, key, value, key_padding_mask=None, need_weights=False,
                attn_mask=None, average_attn_weights=True, is_causal=False):  # fmt: skip
        B, L, _ = query.shape
        S = key.size(1)
        q, k, v = (
            t.view(B, -1, self.H, self.D).transpose(1, 2) for t in self.project(query, key, value)
        )  # (B, H, L|S, D)
        mask = None
        if attn_mask is not None:
            mask = attn_mask.view(1, 1, L, S)  # the mistake: not ~attn_mask
        if key_padding_mask is not None:
            keep = ~key_padding_mask.view(B, 1, 1, S)  # the padding, rightly inverted
            mask = keep if mask is None else mask & keep
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out_proj(self.merge(out)), None


class GQAFirstHeads(SeparateProjMHA):
    """Grouped K/V weights loaded as the first Hkv heads' rows of nn.MHA's K and V rows, where
    each group's head is every G-th head."""

    def group(self, t):
        return t[: self.num_kv_heads * self.head_dim]
