"""Putting a library's decoder attention behind the variant contract: public helpers, and
``DecoderAttention``, which an adapter for transformers' LlamaAttention, MistralAttention or
Qwen2Attention subclasses in about 20 lines (examples/hf_llama.py, hf_mistral.py,
hf_qwen2.py). How to use them: docs/guide.md, "Checking a decoder's attention from a library".

Vocabulary: B batch, L new tokens, P cached ones, S = P + L keys, E embed_dim, H heads, Hkv K/V
heads, D = E // H.

- ``qkvo_state``: nn.MHA's ``in_proj_weight``/``in_proj_bias``/``out_proj`` turned into
  ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj`` (each group's first K/V head for grouped heads,
  ``grouped_rows``), with the biases the module has.
- ``identity_rotary``: rotary embeddings that rotate nothing (cos = 1, sin = 0). nn.MHA has no
  positions; a decoder's attention applies rotary embeddings to q and k, so the two compute the
  same thing only with the identity rotation (the module's projections and attention are
  checked; the rotation is the library's own code, and position-free).
- ``additive_mask``: nn.MHA's ``attn_mask`` (L, S) and ``key_padding_mask`` (B, S) as one additive
  (B|1, 1, L, K) float mask for a library's kernels, ``K`` >= S keys (a static cache returns its
  whole buffer: the keys past S are masked). ``MaskOnce`` keeps it per mask and shape, outside
  the timed call.
- ``LibraryCache``: transformers' DynamicCache (style ``concat``) or StaticCache (``static``)
  with the harness's cache interface: both commit what ``update`` appends, so ``rewind`` returns
  them to the prefix before every timed call (docs/adding.md, "The KV cache contract").
"""

from __future__ import annotations

import torch
import torch.nn as nn

from variants._core import grouped_rows
from variants.masks import merge_masks

__all__ = [
    "DecoderAttention",
    "LibraryCache",
    "MaskOnce",
    "additive_mask",
    "grouped_rows",
    "identity_rotary",
    "library",
    "qkvo_state",
]


def library(module: str, *names: str):
    """``names`` imported from ``module`` when a point is built; where the library does not
    import, NotImplementedError with the reason (the point is ``unsupported``, not an error)."""
    import importlib

    try:
        found = importlib.import_module(module)
        return tuple(getattr(found, name) for name in names)
    except Exception as e:
        raise NotImplementedError(
            f"{module} does not import here ({type(e).__name__}: {e}); see "
            "docs/guide.md, 'Checking a decoder's attention from a library'"
        ) from e


def qkvo_state(
    state_dict: dict,
    prefix: str,
    into: str,
    num_heads: int,
    num_kv_heads: int,
    biases: tuple[bool, bool] = (True, True),
) -> None:
    """nn.MHA's keys under ``prefix`` in ``state_dict`` replaced, in place, by ``{into}q_proj``,
    ``k_proj``, ``v_proj`` and ``o_proj`` (``.weight``, ``.bias``): (E, E), (Hkv*D, E),
    (Hkv*D, E), (E, E). ``biases``: whether the module's q/k/v and o projections have biases; a
    bias it lacks must be zero in nn.MHA's (harness config ``bias=qkv|out`` zeroes it), else
    ValueError naming it."""
    if prefix + "in_proj_weight" not in state_dict:
        return
    wq, wk, wv = state_dict.pop(prefix + "in_proj_weight").chunk(3)  # (3E, E) -> 3 x (E, E)
    b = state_dict.pop(prefix + "in_proj_bias", None)
    bq, bk, bv = b.chunk(3) if b is not None else (None, None, None)  # (3E,) -> 3 x (E,)
    parts = {
        "q_proj": (wq, bq, biases[0]),
        "k_proj": (grouped_rows(wk, num_heads, num_kv_heads), bk, biases[0]),
        "v_proj": (grouped_rows(wv, num_heads, num_kv_heads), bv, biases[0]),
        "o_proj": (
            state_dict.pop(prefix + "out_proj.weight"),
            state_dict.pop(prefix + "out_proj.bias", None),
            biases[1],
        ),
    }
    for name, (w, bias, has) in parts.items():
        state_dict[f"{into}{name}.weight"] = w
        if bias is None:
            continue
        if name in ("k_proj", "v_proj"):
            bias = grouped_rows(bias, num_heads, num_kv_heads)
        if has:
            state_dict[f"{into}{name}.bias"] = bias
        elif bias.detach().abs().max() > 0:
            raise ValueError(
                f"{name} has no bias here, but nn.MultiheadAttention's is not zero: run it with "
                "the bias layout it has (bias=qkv: no output bias; bias=out; bias=false)"
            )


def identity_rotary(x: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of (B, L, D) for ``x`` (B, L, E) that rotate nothing: cos = 1, sin = 0."""
    B, L, _ = x.shape
    cos = torch.ones(B, L, head_dim, dtype=x.dtype, device=x.device)
    return cos, torch.zeros_like(cos)


def additive_mask(
    attn_mask: torch.Tensor | None,
    key_padding_mask: torch.Tensor | None,
    B: int,
    H: int,
    L: int,
    S: int,
    dtype: torch.dtype,
    keys: int | None = None,
) -> torch.Tensor:
    """nn.MHA's masks as one additive (B|1, 1|H, L, keys) mask, never None (a library may read
    None as causal: transformers' sdpa does for L > 1); keys past S (a static cache's unwritten
    slots) are -inf."""
    device = attn_mask if attn_mask is not None else key_padding_mask
    device = device.device if device is not None else None
    mask = merge_masks(attn_mask, key_padding_mask, B, H, L, S, dtype)
    if mask is None:
        mask = torch.zeros(1, 1, L, S, dtype=dtype, device=device)
    keys = keys or S
    if keys > S:  # (..., L, S) -> (..., L, keys)
        pad = torch.full((*mask.shape[:-1], keys - S), float("-inf"), dtype=dtype, device=device)
        mask = torch.cat([mask, pad], dim=-1)
    return mask


class MaskOnce:
    """``additive_mask`` built once per mask tensors and shape, outside the timed call: the
    harness hands a point's calls the same masks (0.7 ms of 2.4 ms per call at 128 tokens was a
    mask rebuilt in every call). Held by the masks' identity and in-place version."""

    def __init__(self):
        self.key, self.mask, self.held = None, None, None

    def __call__(self, attn_mask, key_padding_mask, *shape) -> torch.Tensor:
        masks = (attn_mask, key_padding_mask)
        key = (tuple((id(m), getattr(m, "_version", None)) for m in masks), shape)
        if key != self.key:
            self.key, self.mask, self.held = key, additive_mask(*masks, *shape), masks
        return self.mask


def full_attention(config):
    """``config`` whose layers all keep every token: a sliding-window model's cache keeps only
    the window, and returns fewer keys than the harness's mask covers; the window is the
    mask's (it arrives as nn.MHA's ``attn_mask``)."""
    import copy

    config = copy.deepcopy(config)
    config.sliding_window = None
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = ["full_attention"] * len(config.layer_types)
    return config


class LibraryCache:
    """A transformers cache for one attention layer (``layer_idx`` 0) with the harness's cache
    interface: ``update(k, v)`` returns what the library's cache returns (a static cache: its
    whole buffer of ``capacity``), ``length`` (tokens held), ``advance`` (what has been written
    stays: the point a rewind returns to) and ``rewind``."""

    def __init__(self, style: str, config, batch: int, capacity: int, device, dtype):
        DynamicCache, StaticCache = library("transformers", "DynamicCache", "StaticCache")
        self.style, self.capacity, self.kept = style, capacity, 0
        if style == "static":
            self.cache = StaticCache(config=full_attention(config), max_cache_len=capacity)
        else:
            self.cache = DynamicCache()  # full-attention layers, as without a config

    @property
    def length(self) -> int:
        return int(self.cache.get_seq_length())

    def keys(self, L: int) -> int:
        """How many keys the library returns after ``L`` new tokens."""
        return self.capacity if self.style == "static" else self.length + L

    def positions(self, L: int, device) -> torch.Tensor:
        return torch.arange(self.length, self.length + L, device=device)

    def update(self, k: torch.Tensor, v: torch.Tensor):
        return self.cache.update(k, v, 0, {"cache_position": self.positions(k.size(2), k.device)})

    def advance(self) -> None:
        self.kept = self.length

    def rewind(self) -> None:
        """Back to the ``advance``d length: DynamicCache drops the tokens after it, StaticCache
        writes the next tokens there again (its buffer is left as it is)."""
        extra = self.length - self.kept
        if extra <= 0:
            return
        if self.style == "static":
            for layer in self.cache.layers:
                layer.cumulative_length.fill_(self.kept)
        else:
            self.cache.crop(-extra)


class DecoderAttention(nn.Module):
    """A decoder attention module of transformers' kind (``q_proj``, ``k_proj``, ``v_proj``,
    ``o_proj``; ``forward(hidden_states, position_embeddings, attention_mask, past_key_values,
    cache_position, **kwargs)``) behind nn.MultiheadAttention's forward, with a KV cache.

    A subclass builds the library's config and module and calls ``__init__(attn, config)``;
    ``self.attn`` is checked with identity rotary embeddings, nn.MHA's masks as one additive
    mask built once (``MaskOnce``), or under sdpa nn.MHA's causal hint as the library's own
    ``is_causal`` (its fast path), and the library's caches (``LibraryCache``)."""

    _supports_ = {
        "cross": False,
        "reason": "a decoder's attention attends its hidden states to themselves",
    }

    def __init__(self, attn: nn.Module, config, biases: tuple[bool, bool] = (True, True)):
        super().__init__()
        self.attn, self.config, self.biases = attn, config, biases
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = attn.head_dim
        self.batch_first = True
        self.mask = MaskOnce()
        self._register_load_state_dict_pre_hook(self._load)

    def _load(self, state_dict, prefix, *args):
        heads = (self.num_heads, self.num_kv_heads)
        qkvo_state(state_dict, prefix, prefix + "attn.", *heads, self.biases)

    def new_cache(self, style: str, batch: int, capacity: int, device, dtype) -> LibraryCache:
        return LibraryCache(style, self.config, batch, capacity, device, dtype)

    @torch.no_grad()
    def fill_cache(self, kv_cache: LibraryCache, x: torch.Tensor) -> None:
        """The prefix's keys and values (B, Hkv, P, D), unrotated (identity rotary), cached."""
        B, P, _ = x.shape
        k = self.attn.k_proj(x).view(B, P, -1, self.head_dim).transpose(1, 2)
        v = self.attn.v_proj(x).view(B, P, -1, self.head_dim).transpose(1, 2)
        kv_cache.update(k, v)
        kv_cache.advance()

    def forward(
        self,
        query,
        key,
        value,
        key_padding_mask=None,
        need_weights=False,
        attn_mask=None,
        average_attn_weights=True,
        is_causal=False,
        kv_cache: LibraryCache | None = None,
    ):
        if not (query is key and key is value):
            raise NotImplementedError("cross-attention: a decoder attends its hidden states")
        sdpa = self.config._attn_implementation == "sdpa"
        if need_weights and sdpa:
            raise NotImplementedError("need_weights=True: transformers' sdpa returns no weights")
        B, L, _ = query.shape
        S = L + (kv_cache.length if kv_cache is not None else 0)
        library_kwargs = {}
        if kv_cache is not None:
            library_kwargs = dict(
                past_key_values=kv_cache.cache, cache_position=kv_cache.positions(L, query.device)
            )
        if sdpa and is_causal and key_padding_mask is None and kv_cache is None:
            mask, library_kwargs["is_causal"] = None, True  # the library's own causal path
        else:  # explicit: eager ignores an is_causal keyword, and sdpa reads None as causal
            keys = kv_cache.keys(L) if kv_cache is not None else S
            mask = self.mask(
                attn_mask, key_padding_mask, B, self.num_heads, L, S, query.dtype, keys
            )
            library_kwargs["is_causal"] = False
        out, weights = self.attn(
            query,
            position_embeddings=identity_rotary(query, self.head_dim),
            attention_mask=mask,
            **library_kwargs,
        )  # (B, L, E), eager: (B, H, L, keys)
        if not need_weights:
            return out, None
        weights = weights[..., :S]  # a static cache's unwritten slots
        return out, (weights.mean(dim=1) if average_attn_weights else weights)
