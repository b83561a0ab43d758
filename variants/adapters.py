"""Putting a library's decoder attention behind the variant contract: public helpers, and
``DecoderAttention``, the adapter's base class, which takes what it assumes of the library's
module as arguments. Adapters for transformers' Llama, Mistral, Qwen2, GPT-2 and GPT-NeoX
attention are under 20 lines each (examples/hf_*.py). How to use them: docs/guide.md, "Checking
a decoder's attention from a library".

Vocabulary: B batch, L new tokens, P cached ones, S = P + L keys, E embed_dim, H heads, Hkv K/V
heads, D = E // H, G = H // Hkv.

- ``projection_state``: nn.MHA's ``in_proj_weight``/``in_proj_bias``/``out_proj`` in the
  module's layout: separate q, k, v projections or one fused one (q | k | v blocks, or per head
  [H, 3, D], per K/V group with grouped heads), Linear (out, in) or Conv1D-style (in, out)
  weights, the module's names, the biases it has. ``qkvo_state``: Llama's separate ``q_proj``,
  ``k_proj``, ``v_proj``, ``o_proj``. Grouped K/V heads keep each group's first head
  (``grouped_rows``).
- ``library_rope`` (variants/library_rotary.py): the library's own rotary embedding module for
  a point with rotary embeddings (``rotary=``), configured by ``library_attention(...,
  rotary=rotary)``; the checker's oracle rotates as the point says (harness/features/rotary.py),
  so the library's rotation is checked with the rest. ``identity_rotary``: the rotation that
  turns nothing (cos = 1, sin = 0), which a point without rotary embeddings is checked with.
- ``additive_mask``: nn.MHA's ``attn_mask`` (L, S) and ``key_padding_mask`` (B, S) as one additive
  (B|1, 1, L, K) float mask for a library's kernels, ``K`` >= S keys (a static cache returns its
  whole buffer: the keys past S are masked). ``MaskOnce`` keeps it per mask and shape, outside
  the timed call.
- ``sinks_state`` and ``LibraryAlibi`` (variants/library_bias.py): a library's attention sinks
  under any name, shape and head order, and its ALiBi tensor (the library's own where the class
  takes ``position_bias``, zeros where the harness hands the bias in the mask).
- ``LibraryCache``: transformers' DynamicCache (style ``concat``) or StaticCache (``static``) as
  a ``KVCache`` (variants/cache.py): both commit what ``update`` appends, so ``rewind`` returns
  them to the prefix before every timed call (docs/adding.md, "The KV cache contract").
"""

from __future__ import annotations

import torch
import torch.nn as nn

from variants._core import grouped_rows
from variants.cache import KVCache, PositionCache  # noqa: F401 (PositionCache: adapters import it here)
from variants.library_bias import LibraryAlibi, sinks_state
from variants.library_rotary import Angles, identity_rotary, library_rope, rope_config, whole_heads
from variants.libraries import library  # noqa: F401 (a public helper: adapters import it here)
from variants.masks import merge_masks

__all__ = [
    "DecoderAttention",
    "KVCache",
    "LibraryAlibi",
    "LibraryCache",
    "MaskOnce",
    "additive_mask",
    "grouped_rows",
    "identity_rotary",
    "library",
    "library_attention",
    "library_rope",
    "projection_state",
    "qkvo_state",
    "sinks_state",
    "whole_heads",
]


def library_attention(module: str, name: str, rotary: dict | None = None, **options):
    """transformers' ``{name}Attention`` of ``module`` for layer 0 and its ``{name}Config``
    (``options``, one hidden layer, the point's rotary embeddings ``rotary`` as the config says
    them): (attn, config). Where the library does not import, NotImplementedError with the
    reason (``library``)."""
    Config, Attention = library(module, f"{name}Config", f"{name}Attention")
    config = Config(num_hidden_layers=1, **rope_config(rotary), **options)
    return Attention(config, layer_idx=0), config


# How a fused projection orders its rows: "qkv", every query head, then the K heads, then the V
# heads (GPT-2's c_attn, timm's qkv, grouped-query models' Wqkv); "heads", per K/V head its group's
# G query heads, then its K head, then its V head ([H, 3, D] without grouping: GPT-NeoX's
# query_key_value; variants/packed.py's layout).
ORDERS = ("qkv", "heads")


def projection_state(
    state_dict: dict,
    prefix: str,
    into: str,
    num_heads: int,
    num_kv_heads: int | None = None,
    *,
    qkv: str | tuple[str, str, str] = "qkv",
    out: str = "out_proj",
    order: str = "qkv",
    transposed: bool = False,
    biases: tuple[bool, bool] = (True, True),
) -> None:
    """nn.MHA's keys under ``prefix`` in ``state_dict`` replaced, in place, by the module's
    projections under ``into``: ``qkv`` one fused projection's name, or three names for separate
    q, k and v projections ((E, E), (Hkv*D, E), (Hkv*D, E)); ``out`` the output projection's
    (``out_proj``, ``o_proj``, ``dense``, ``c_proj``, ``proj``). A fused weight has (H + 2 Hkv)*D
    rows in ``order`` (``ORDERS``). ``transposed``: the weights as Conv1D-style modules hold
    them, (in, out), used as x @ W (GPT-2's). Grouped heads (``num_kv_heads`` < ``num_heads``)
    keep each group's first K/V head (``grouped_rows``). ``biases``: whether the module's q/k/v
    and output projections have biases; a bias it lacks must be zero in nn.MHA's (harness config
    ``bias=qkv|out`` zeroes it), else ValueError naming it. Plain tensor ops: the checker maps
    gradients back through them (harness/way/calls.py)."""
    if prefix + "in_proj_weight" not in state_dict:
        return
    if order not in ORDERS:
        raise ValueError(f"order={order!r} is not one of {'|'.join(ORDERS)}")
    if order != "qkv" and not isinstance(qkv, str):
        raise ValueError(f"order={order!r} orders one fused projection; qkv={qkv!r} is three")
    H, Hkv = num_heads, num_kv_heads or num_heads
    weight = state_dict.pop(prefix + "in_proj_weight")  # (3E, E): [Wq; Wk; Wv]
    bias = state_dict.pop(prefix + "in_proj_bias", None)  # (3E,)
    parts = {}  # name -> (weight (out, in), bias (out,) or None, whether the module has one)
    for t, kind in ((weight, "weight"), (bias, "bias")):
        if t is None:
            continue
        q, k, v = t.chunk(3)  # (E, ...) each
        k, v = grouped_rows(k, H, Hkv), grouped_rows(v, H, Hkv)  # (Hkv*D, ...)
        if isinstance(qkv, str):
            named = {qkv: fused_rows(q, k, v, order, H, Hkv)}
        else:
            named = dict(zip(qkv, (q, k, v)))
        for name, rows in named.items():
            parts.setdefault(name, [None, None, biases[0]])[kind == "bias"] = rows
    parts[out] = [
        state_dict.pop(prefix + "out_proj.weight"),  # (E, E)
        state_dict.pop(prefix + "out_proj.bias", None),
        biases[1],
    ]
    for name, (w, b, has) in parts.items():
        state_dict[f"{into}{name}.weight"] = w.t() if transposed else w
        if b is None:
            continue
        if has:
            state_dict[f"{into}{name}.bias"] = b
        elif b.detach().abs().max() > 0:
            raise ValueError(
                f"{name} has no bias here, but nn.MultiheadAttention's is not zero: run it with "
                "the bias layout it has (bias=qkv: no output bias; bias=out; bias=false)"
            )


def fused_rows(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, order: str, H: int, Hkv: int
) -> torch.Tensor:
    """q (H*D, ...), k and v (Hkv*D, ...) -> one fused ((H + 2 Hkv)*D, ...) in ``order``."""
    if order == "qkv":
        return torch.cat([q, k, v])
    rest = q.shape[1:]
    groups = [
        q.reshape(Hkv, H // Hkv, -1, *rest),  # (Hkv, G, D, ...)
        k.reshape(Hkv, 1, -1, *rest),
        v.reshape(Hkv, 1, -1, *rest),
    ]
    return torch.cat(groups, dim=1).reshape(-1, *rest)  # (Hkv, G + 2, D, ...) -> rows


def qkvo_state(
    state_dict: dict,
    prefix: str,
    into: str,
    num_heads: int,
    num_kv_heads: int,
    biases: tuple[bool, bool] = (True, True),
) -> None:
    """``projection_state`` into Llama's layout: ``{into}q_proj``, ``k_proj``, ``v_proj`` and
    ``o_proj`` (``.weight``, ``.bias``): (E, E), (Hkv*D, E), (Hkv*D, E), (E, E)."""
    projection_state(
        state_dict,
        prefix,
        into,
        num_heads,
        num_kv_heads,
        qkv=("q_proj", "k_proj", "v_proj"),
        out="o_proj",
        biases=biases,
    )


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


def batch_mask(
    attn_mask: torch.Tensor | None,
    key_padding_mask: torch.Tensor | None,
    B: int,
    H: int,
    L: int,
    S: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """nn.MHA's masks (``attn_mask`` (L, S) or (B*H, L, S), ``key_padding_mask`` (B, S), bool
    True = may not attend) as one additive (B, L, S) mask, the form libraries that take a mask per
    sequence want (diffusers' ``Attention``: ``attention_mask`` (B, L, S)); zeros where there is
    none. ValueError for a per-head ``attn_mask`` whose heads differ: it has no (B, L, S) form."""
    mask = additive_mask(attn_mask, key_padding_mask, B, H, L, S, dtype)  # (B|1, 1|H, L, S)
    if mask.size(1) > 1:
        if not torch.equal(mask, mask[:, :1].expand_as(mask)):
            raise ValueError("a per-head attn_mask has no (B, L, S) form: its heads differ")
        mask = mask[:, :1]
    return mask[:, 0].expand(B, L, S)  # (B, L, S)


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


class LibraryCache(KVCache):
    """A transformers cache for one attention layer (``layer_idx`` 0) as a ``KVCache``:
    ``update(k, v)`` returns what the library's cache returns (a static cache: its whole buffer
    of ``capacity``, ``keys``), and ``crop`` drops the tokens after the first n (DynamicCache) or
    writes the next tokens there again (StaticCache: its buffer is left as it is)."""

    def __init__(self, style: str, config, batch: int, capacity: int, device, dtype):
        DynamicCache, StaticCache = library("transformers", "DynamicCache", "StaticCache")
        self.style = style
        if style == "static":
            cache = StaticCache(config=full_attention(config), max_cache_len=capacity)
        else:
            cache = DynamicCache()  # full-attention layers, as without a config
        super().__init__(capacity, cache)

    @property
    def length(self) -> int:
        return int(self.cache.get_seq_length())

    def keys(self, L: int) -> int:
        return self.capacity if self.style == "static" else self.length + L

    def update(self, k: torch.Tensor, v: torch.Tensor):
        return self.cache.update(k, v, 0)

    def crop(self, n: int) -> None:
        if self.style == "static":
            for layer in self.cache.layers:
                layer.cumulative_length.fill_(n)
        elif n < self.length:
            self.cache.crop(n - self.length)  # DynamicCache crops a negative count of tokens


# Where DecoderAttention looks for what it is not given: (argument, what it is, where).
FOUND_IN = (
    ("num_heads", "the number of query heads", (("config", "num_attention_heads"),)),
    ("num_kv_heads", "the number of K/V heads", (("config", "num_key_value_heads"),)),
    ("head_dim", "the head size", (("attn", "head_dim"), ("config", "head_dim"))),
)


class DecoderAttention(nn.Module):
    """A library's decoder attention module ``attn`` behind nn.MultiheadAttention's forward,
    with the library's KV cache. What it assumes of the module is an argument:

    - ``num_heads``, ``num_kv_heads``, ``head_dim``: where not given, ``config``'s
      ``num_attention_heads`` and ``num_key_value_heads``, and ``attn.head_dim`` (or
      ``config.head_dim``); where none is there, ValueError naming the argument to pass.
    - ``layout``: ``projection_state``'s keywords for the module's projections (Llama's
      ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj`` unless given); ``biases``: whether its
      q/k/v and output projections have biases.
    - ``cache``: the forward keyword the module takes its cache by (``past_key_values``;
      GPT-NeoX's ``layer_past``).
    - ``rotary``: the keyword of its rotary embeddings (cos, sin); None for a module without
      (GPT-2's). ``rope``: the library's rotary embedding module (``library_rope``), whose cos
      and sin it is handed at the new tokens' positions (after the cache's); None: the identity
      rotation (``identity_rotary``), where the point has none.
    - ``sinks``: the name of the module's attention sinks parameter (``sinks_state``: any
      shape); ``sink_heads`` its head order where it is not the query heads'.
    - ``prefix_kv``: how the prefix's keys and values reach the cache. None: the module itself
      runs on the prefix with its cache, and its own projections write them; else a function
      (attn, x (B, P, E)) -> k, v (B, Hkv, P, D), passed to the cache's ``update``.

    The module is called as ``attn(hidden_states, attention_mask=mask, **{rotary: (cos, sin),
    cache: its cache}, is_causal=...)`` and returns (out (B, L, E), weights or None). The mask
    is nn.MHA's masks as one additive mask built once (``MaskOnce``), or under transformers'
    sdpa, nn.MHA's causal hint as the library's own ``is_causal`` (its fast path). Hooks a
    subclass may override: ``map_weights`` (nn.MHA's state dict into the module's layout),
    ``new_cache`` (the library's cache as a ``KVCache``; transformers' by default,
    ``LibraryCache``) and ``fill_cache`` (the prefix into it)."""

    _supports_ = {
        "cross": False,
        "reason": "a decoder's attention attends its hidden states to themselves",
    }

    def __init__(
        self,
        attn: nn.Module,
        config=None,
        biases: tuple[bool, bool] = (True, True),
        *,
        num_heads: int | None = None,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        layout: dict | None = None,
        cache: str = "past_key_values",
        rotary: str | None = "position_embeddings",
        prefix_kv=None,
        rope=None,
        sinks: str = "sinks",
        sink_heads=None,
    ):
        super().__init__()
        self.attn, self.config, self.biases = attn, config, biases
        given = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)
        for arg, what, places in FOUND_IN:
            setattr(self, arg, self.found(given[arg], arg, what, places))
        self.layout = layout or dict(qkv=("q_proj", "k_proj", "v_proj"), out="o_proj")
        self.cache_keyword, self.rotary, self.prefix_kv = cache, rotary, prefix_kv
        self.sinks_name, self.sink_heads = sinks, sink_heads
        self.angles = Angles(rope, self.head_dim)  # not a submodule: its float32 stays float32
        self.batch_first = True
        self.mask = MaskOnce()
        self._register_load_state_dict_pre_hook(self._load)

    def found(self, value, arg: str, what: str, places) -> int:
        """``value``, else the first of ``places`` (("attn" | "config", attribute), ...) there."""
        if value is not None:
            return value
        owners = {"attn": self.attn, "config": self.config}
        for owner, name in places:
            if getattr(owners[owner], name, None) is not None:
                return getattr(owners[owner], name)
        looked = " or ".join(
            f"{type(owners[o]).__name__}.{name}" if owners[o] is not None else f"{o}.{name}"
            for o, name in places
        )
        raise ValueError(
            f"{type(self).__name__} cannot tell {what}: there is no {looked}; pass {arg}= to "
            "DecoderAttention.__init__"
        )

    def _load(self, state_dict, prefix, *args):
        self.map_weights(state_dict, prefix)

    def map_weights(self, state_dict: dict, prefix: str) -> None:
        """nn.MHA's keys under ``prefix`` replaced by the module's (under ``prefix + "attn."``),
        in place, with plain tensor ops (the checker maps gradients back through them)."""
        heads = (self.num_heads, self.num_kv_heads)
        projection_state(
            state_dict, prefix, prefix + "attn.", *heads, biases=self.biases, **self.layout
        )
        sinks_state(  # attention sinks (H,): the module's own parameter
            state_dict, prefix, prefix + "attn.", self.attn, self.sinks_name, self.sink_heads
        )
        for norm in ("q_norm", "k_norm"):  # QK-norm's weights: the library's RMSNorm modules
            if prefix + norm in state_dict:
                state_dict[f"{prefix}attn.{norm}.weight"] = state_dict.pop(prefix + norm)

    def new_cache(self, style: str, batch: int, capacity: int, device, dtype) -> KVCache:
        """An empty cache for ``capacity`` tokens: transformers' (``LibraryCache``)."""
        if self.config is None:
            raise NotImplementedError(
                f"{type(self).__name__} has no transformers config for a LibraryCache: override "
                "new_cache to return the library's cache as a KVCache (variants/cache.py)"
            )
        return LibraryCache(style, self.config, batch, capacity, device, dtype)

    @torch.no_grad()
    def fill_cache(self, kv_cache: KVCache, x: torch.Tensor) -> None:
        """The prefix's keys and values (B, Hkv, P, D), cached: by ``prefix_kv`` (keys as it
        rotates them), or by the module itself run on the prefix ``x`` (B, P, E) at positions
        0 .. P - 1."""
        if self.prefix_kv is not None:
            kv_cache.update(*self.prefix_kv(self.attn, x))
        else:  # the output is not used: a mask that hides only a static buffer's empty slots
            P = x.size(1)
            mask = additive_mask(None, None, 1, 1, P, P, x.dtype, kv_cache.keys(P))
            self._called(x, mask, self.library_kwargs(x, kv_cache), kv_cache)
            if kv_cache.length != P:
                raise ValueError(
                    f"{type(self.attn).__name__} left {kv_cache.length} tokens in its cache "
                    f"after a prefix of {P}, passed as {self.cache_keyword}=. Either its forward "
                    "takes the cache by another keyword (pass cache= to "
                    "DecoderAttention.__init__), or the module writes its cache at positions and "
                    f"{type(kv_cache).__name__}.length does not count its writes (return a "
                    "PositionCache from new_cache: it counts the positions it hands out)"
                )
        kv_cache.advance()

    def call(self, x: torch.Tensor, mask, kwargs: dict, kv_cache: KVCache | None):
        """The library's module called once: ``x`` (B, L, E), ``mask`` the additive (B|1, 1|H,
        L, keys) mask (None: the library's own causal path, ``kwargs["is_causal"]``), ``kwargs``
        its rotary embeddings and cache by their keywords (``library_kwargs``). Returns (out (B,
        L, E), weights (B, H, L, keys) or None). By default transformers' call,
        ``attn(x, attention_mask=mask, **kwargs)``; a module called otherwise overrides this
        (torchtune's ``attn(x, mask=..., input_pos=kv_cache.positions(L))``); a
        ``PositionCache`` counts the L positions written after it returns."""
        out = self.attn(x, attention_mask=mask, **kwargs)
        return (out, None) if torch.is_tensor(out) else tuple(out[:2])

    def _called(self, x, mask, kwargs: dict, kv_cache: KVCache | None):
        """``call``, then a ``PositionCache`` counts the positions it wrote."""
        out = self.call(x, mask, kwargs, kv_cache)
        if isinstance(kv_cache, PositionCache):
            kv_cache.wrote(x.size(1))
        return out

    def library_kwargs(self, x: torch.Tensor, kv_cache: KVCache | None) -> dict:
        """The module's rotary embeddings (at positions after the cache's) and cache, by its
        keywords."""
        kwargs = {}
        if self.rotary is not None:
            kwargs[self.rotary] = self.angles(x, kv_cache.length if kv_cache is not None else 0)
        if kv_cache is not None:
            kwargs[self.cache_keyword] = kv_cache.cache
        return kwargs

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
        kv_cache: KVCache | None = None,
    ):
        if not (query is key and key is value):
            raise NotImplementedError("cross-attention: a decoder attends its hidden states")
        sdpa = getattr(self.config, "_attn_implementation", None) == "sdpa"
        if need_weights and sdpa:
            raise NotImplementedError("need_weights=True: transformers' sdpa returns no weights")
        B, L, _ = query.shape
        S = L + (kv_cache.length if kv_cache is not None else 0)
        library_kwargs = self.library_kwargs(query, kv_cache)
        if sdpa and is_causal and key_padding_mask is None and kv_cache is None:
            mask, library_kwargs["is_causal"] = None, True  # the library's own causal path
        else:  # explicit: eager ignores an is_causal keyword, and sdpa reads None as causal
            keys = kv_cache.keys(L) if kv_cache is not None else S
            mask = self.mask(
                attn_mask, key_padding_mask, B, self.num_heads, L, S, query.dtype, keys
            )
            library_kwargs["is_causal"] = False
        out, weights = self._called(query, mask, library_kwargs, kv_cache)
        if not need_weights:  # out (B, L, E), weights (B, H, L, keys)
            return out, None
        if weights is None:
            raise NotImplementedError(f"need_weights=True: {type(self.attn).__name__} returns none")
        weights = weights[..., :S]  # a static cache's unwritten slots
        return out, (weights.mean(dim=1) if average_attn_weights else weights)
