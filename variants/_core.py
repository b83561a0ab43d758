"""Pieces every hand-written variant shares: the options, the forward, the head merge.

Kept in one place so that a toggle (``attention=<a kernel of variants/kernels/>``,
``merge=view|reshape``) means exactly the same thing in every structure; the structures differ
only in how they project. Vocabulary: B batch, L query length, S key length, E embed_dim,
H heads, Hkv K/V heads (grouped-query attention: H // Hkv query heads share one), D = E // H.

Grouped-query weights and nn.MultiheadAttention (docs/adding.md, "Grouped heads, a KV cache, a
window"): nn.MHA has no grouped heads, so a grouped-query module is the nn.MHA whose K/V heads
repeat per group: query head h uses K/V head h // G (G = H // Hkv), as SDPA's enable_gqa and
Llama's repeat_kv do. Loading such a state dict keeps each group's first K/V head
(``grouped_rows``); a state dict whose heads do not repeat is refused rather than silently
thinned.
"""

from __future__ import annotations

import torch

from harness.declarations import MERGES
from variants import kernels
from variants.cache import make_cache
from variants.kernels.manual import attend_with_weights
from variants.masks import Masks
from variants.positions import alibi_slopes
from variants.qk_norm import normed
from variants.rotary import Rotary


def check_options(
    name: str,
    embed_dim: int,
    num_heads: int,
    attention: str,
    merge: str,
    num_kv_heads: int = 1,
) -> None:
    """Raise ValueError naming the bad value; the harness records it as ``invalid``."""
    if num_heads <= 0 or embed_dim <= 0 or num_kv_heads <= 0:
        raise ValueError(
            f"{name}: embed_dim={embed_dim}, num_heads={num_heads} and "
            f"num_kv_heads={num_kv_heads} must be positive"
        )
    if embed_dim % num_heads:
        raise ValueError(f"{name}: embed_dim={embed_dim} is not divisible by num_heads={num_heads}")
    if num_heads % num_kv_heads:
        raise ValueError(
            f"{name}: num_kv_heads={num_kv_heads} does not divide num_heads={num_heads}"
        )
    kernels.get(attention)  # ValueError naming the value when no kernel has that name
    if merge not in MERGES:
        raise ValueError(f"{name}: merge={merge!r} is not one of {'|'.join(MERGES)}")


def grouped_rows(t: torch.Tensor, num_heads: int, kv_heads: int) -> torch.Tensor:
    """nn.MHA's K or V rows (H*D, ...) -> a grouped module's (Hkv*D, ...): each group's first
    head. Differentiable (the checker maps gradients back through it). ValueError when the heads
    of a group differ: that state dict is no grouped-query model's."""
    groups = num_heads // kv_heads
    if groups == 1:
        return t
    heads = t.reshape(kv_heads, groups, -1, *t.shape[1:])  # (Hkv, G, D, ...)
    first = heads[:, :1]  # (Hkv, 1, D, ...)
    if not torch.equal(heads.detach(), first.detach().expand_as(heads)):
        raise ValueError(
            f"num_kv_heads={kv_heads}: nn.MultiheadAttention's K/V heads do not repeat in groups "
            f"of {groups} (query head h uses K/V head h // {groups}); this state dict is not a "
            "grouped-query model's"
        )
    return first.reshape(-1, *t.shape[1:])  # (Hkv*D, ...)


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, Hkv, S, D) -> (B, H, S, D): each K/V head repeated for its group's query heads."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def merge_heads(out: torch.Tensor, how: str) -> torch.Tensor:
    """(B, H, L, D) -> (B, L, E). ``view`` needs the explicit copy; ``reshape`` copies
    implicitly."""
    B, H, L, D = out.shape
    out = out.transpose(1, 2)  # (B, L, H, D), no longer contiguous
    if how == "view":
        return out.contiguous().view(B, L, H * D)  # (B, L, E)
    return out.reshape(B, L, H * D)  # (B, L, E)


def pack_weights(
    attn_weights: torch.Tensor | None, average_attn_weights: bool
) -> torch.Tensor | None:
    """nn.MHA returns weights averaged over heads (B, L, S) unless asked for (B, H, L, S)."""
    if attn_weights is None:
        return None
    return attn_weights.mean(dim=1) if average_attn_weights else attn_weights


def split_in_proj(state_dict: dict, prefix: str) -> tuple[list, list | None]:
    """nn.MHA's [Wq; Wk; Wv] (3E, E) and [bq; bk; bv] (3E,) popped from a state dict, per part."""
    w = state_dict.pop(prefix + "in_proj_weight")
    b = state_dict.pop(prefix + "in_proj_bias", None)
    return list(w.chunk(3, dim=0)), (list(b.chunk(3, dim=0)) if b is not None else None)


class HandWrittenMHA(torch.nn.Module):
    """The forward that every hand-written structure shares; subclasses only say how to project.

    Subclasses create their layers in ``layers`` (``self.out_proj`` among them, nn.Linear(E, E)),
    map nn.MHA's state dict onto them in ``load_hook`` and implement ``project``.
    """

    # How findings name the structure ("one fused QKV projection"); empty: "structure=<name>".
    # A run writes it into its ways.json (harness/sweep/facts.py); the report reads it there.
    title = ""

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        bias: bool = True,
        attention: str = "sdpa",
        merge: str = "view",
        num_kv_heads: int | None = None,
        position_bias: str = "none",
        sinks: bool = False,
        rotary: dict | None = None,
        qk_norm: dict | None = None,
    ):
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        check_options(type(self).__name__, embed_dim, num_heads, attention, merge, num_kv_heads)
        if position_bias not in ("none", "alibi"):
            raise ValueError(
                f"{type(self).__name__}: position_bias={position_bias!r} is not none|alibi"
            )
        # The bias it adds itself (the harness then hands it no mask for it: harness/way/calls.py,
        # for_module); ALiBi's slopes per query head, the kernels' Masks.slopes.
        self.position_bias = position_bias
        self.slopes = alibi_slopes(num_heads) if position_bias == "alibi" else None
        self.embed_dim, self.num_heads, self.head_dim = embed_dim, num_heads, embed_dim // num_heads
        self.num_kv_heads, self.groups = num_kv_heads, num_heads // num_kv_heads
        self.kv_dim = num_kv_heads * self.head_dim  # width of the K and V projections
        self.attention, self.merge = attention, merge
        self.kernel = kernels.get(attention)
        # A missing optional package is `unsupported` before anything runs (with how to install it).
        missing = self.kernel.unavailable()
        if missing:
            raise NotImplementedError(missing)
        # The kernel the harness reports when no SDPA op ran (its sdpa_kernel column).
        self.attention_kernel = self.kernel.name if self.kernel.names_itself else None
        self.batch_first = True  # what callers of nn.MultiheadAttention check for
        self.layers(embed_dim, bias)
        # Attention sinks (gpt-oss): one logit per query head, loaded from the state dict as
        # nn.MHA's `sinks` (harness/features/sinks.py); the kernels get them in Masks.sinks.
        self.sinks = torch.nn.Parameter(torch.zeros(num_heads)) if sinks else None
        # Rotary embeddings (harness/features/rotary.py's spec): q and k turned at their
        # positions after the projections, the keys before they are cached (variants/rotary.py).
        self.rotary = None if rotary is None else Rotary(rotary, self.head_dim)
        # QK-norm (harness/features/qk_norm.py's spec): q and k normed before the rotation, with
        # weights loaded as nn.MHA's `q_norm` and `k_norm` (variants/qk_norm.py).
        self.qk_norm = qk_norm
        if qk_norm is not None:
            size = self.head_dim if qk_norm["over"] == "head" else embed_dim
            self.q_norm = torch.nn.Parameter(torch.ones(size))
            self.k_norm = torch.nn.Parameter(torch.ones(size))
        self._register_load_state_dict_pre_hook(self.load_hook)

    def layers(self, embed_dim: int, bias: bool) -> None:
        raise NotImplementedError

    def load_hook(self, state_dict, prefix, *args) -> None:
        raise NotImplementedError

    @classmethod
    def kernel_supports(cls, options: dict) -> tuple[str, dict, str | None] | None:
        """(kernel name, what it supports, why it cannot run here or None) for a variant with
        these options, None when they name no kernel: harness/way/capabilities.py applies it before
        the module is built."""
        import inspect

        default = inspect.signature(cls).parameters.get("attention")
        name = options.get("attention", default.default if default is not None else None)
        if not isinstance(name, str):
            return None
        kernel = kernels.get(name)
        return kernel.name, {**kernel.supports(), "reason": kernel.reason}, kernel.unavailable()

    def project(self, query, key, value):  # -> q (B, H, L, D), k and v (B, Hkv, S, D)
        raise NotImplementedError

    def repeat_kv(self, x: torch.Tensor) -> torch.Tensor:
        """(B, Hkv, S, D) -> (B, H, S, D) for kernels that want every head's K/V."""
        return repeat_kv(x, self.groups)

    def group(self, t: torch.Tensor) -> torch.Tensor:
        """nn.MHA's K or V rows (E, ...) -> this module's (Hkv*D, ...) (see ``grouped_rows``)."""
        return grouped_rows(t, self.num_heads, self.num_kv_heads)

    def new_cache(
        self, style: str, batch: int, capacity: int, device, dtype, page_size=None, page_table=None
    ):
        """An empty KV cache for ``capacity`` tokens: static, concat or paged (variants/cache.py;
        paged: in pages of ``page_size`` tokens, at the pool pages ``page_table`` (B, N) lists)."""
        paged = {} if style != "paged" else dict(page_size=page_size, page_table=page_table)
        H, D = self.num_kv_heads, self.head_dim
        return make_cache(style, batch, H, capacity, D, device, dtype, **paged)

    @torch.no_grad()
    def fill_cache(self, kv_cache, x: torch.Tensor) -> None:
        """Put the keys and values of the tokens ``x`` (B, P, E) into ``kv_cache``, as a prefill
        leaves them (their attention output is not needed, so it is not computed)."""
        _, k, v = self.project(x, x, x)  # (B, Hkv, P, D)
        if self.qk_norm is not None:
            k = normed(k, self.k_norm, self.qk_norm["eps"], self.qk_norm["over"])
        if self.rotary is not None:
            k = self.rotary.turn(k, kv_cache.length)
        kv_cache.update(k, v)
        if hasattr(kv_cache, "advance"):  # a cache whose update commits may have none
            kv_cache.advance()

    def cached(self, name: str, masks: tuple, extra: tuple, build):
        """``build()`` once per mask and shape, outside the timed call: a block mask evaluates the
        mask over the whole (L, S) grid, and xformers' dense bias copies it to (B, H, L, S), as
        costly as attention itself. Keyed on the mask tensors themselves (held in the cache, so
        their ids cannot be reused) and their in-place version; the harness passes the same
        masks to every call of a point."""
        key = (tuple((id(m), getattr(m, "_version", None)) for m in masks), extra)
        cache = self.__dict__.setdefault("_mask_cache", {})
        if name not in cache or cache[name][0] != key:
            cache[name] = (key, build(), masks)
        return cache[name][1]

    def split_heads(self, x: torch.Tensor, heads: int | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        # (B, T, heads * D) -> (B, heads, T, D); heads: H, or Hkv for keys and values
        return x.view(B, T, heads or self.num_heads, self.head_dim).transpose(1, 2)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = False,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
        kv_cache=None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """nn.MultiheadAttention's forward, plus ``kv_cache`` (variants/cache.py): a decode step
        whose L new tokens attend to the P cached ones and their own; ``attn_mask`` is then
        (L, P + L)."""
        q, k, v = self.project(query, key, value)  # (B, H, L, D), (B, Hkv, S, D), (B, Hkv, S, D)
        if self.qk_norm is not None:  # before the rotation, as Qwen3, Gemma 3 and OLMo 2
            eps, over = self.qk_norm["eps"], self.qk_norm["over"]
            q, k = normed(q, self.q_norm, eps, over), normed(k, self.k_norm, eps, over)
        if self.rotary is not None:  # the new tokens continue from the cache's length
            start = 0 if kv_cache is None else kv_cache.length
            q, k = self.rotary.turn(q, start), self.rotary.turn(k, start)
        if kv_cache is not None:
            k, v = kv_cache.update(k, v)  # (B, Hkv, P + L, D)
        if self.groups > 1 and (need_weights or not self.kernel.gqa):
            k, v = self.repeat_kv(k), self.repeat_kv(v)  # (B, H, S, D)
        out, weights = self.attend(q, k, v, key_padding_mask, need_weights, attn_mask, is_causal)
        out = self.out_proj(merge_heads(out, self.merge))  # (B, L, E)
        return out, pack_weights(weights, average_attn_weights)

    def attend(self, q, k, v, key_padding_mask, need_weights, attn_mask, is_causal):
        """The heads' attention: q (B, H, L, D), k and v (B, H or Hkv, S, D) -> (B, H, L, Dv)
        and the weights (B, H, L, S) where asked for, under the point's masks."""
        B, L, S = q.size(0), q.size(2), k.size(2)
        # Like nn.MHA: trust the is_causal hint (drop the explicit mask) only when nothing else
        # has to be merged in and no weights are wanted; otherwise apply the mask as given.
        use_hint = is_causal and key_padding_mask is None and not need_weights
        masks = Masks(
            None if use_hint else attn_mask,
            key_padding_mask,
            causal=use_hint or (is_causal and attn_mask is None),
            B=B,
            H=self.num_heads,
            L=L,
            S=S,
            cache=self.cached,
            slopes=self.slopes,
            sinks=self.sinks,
        )
        if need_weights:  # no fused kernel returns them: the explicit path, as nn.MHA does
            return attend_with_weights(q, k, v, masks)  # (B, H, L, Dv), (B, H, L, S)
        return self.kernel.fn(q, k, v, masks), None  # (B, H, L, Dv)
