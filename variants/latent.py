"""Multi-head latent attention (DeepSeek-V2 and V3, Kimi K2) written by hand, in the two forms a
model runs it (``form=``):

- ``naive``: the keys and values up-projected from the latent for every head, then attention as
  any module computes it (the heads' values padded with zeros to head_dim, as DeepSeek's flash
  path does, so that one cache and every kernel take them; the padding's outputs are dropped
  before the out-projection). Its KV cache holds every head's keys and values.
- ``absorbed``: what serving engines run for decoding. W_UK,h is folded into each head's query
  (q_lat = q_nope W_UK,h, (B, H, L, r)) and W_UV,h into its output, so that every head attends
  to the same latent keys [rope key; c_kv] and values c_kv: one K/V "head" of d_r + r channels,
  which is what its cache holds (as keys and again as values: the harness's caches keep K and V
  apart). The kernels scale by 1/sqrt(their q width): q is multiplied by sqrt((d_r + r) / D)
  first, so that the scores keep MLA's 1/sqrt(D). The heads are folded into the query rows
  (one head of H * L queries), as FlashMLA does, except where a head has its own bias or sink.

The math and the factors' names: harness/features/latent.py (the oracle's). Per head the rope
channels come first, [rope; nope], as the oracle's q_up rows hold them. Vocabulary: B batch,
H heads, L queries, S keys, E embed_dim, D head_dim, d_r rope channels, d_n = D - d_r, d_v the
values', r kv_lora_rank.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from variants._core import HandWrittenMHA, merge_heads, pack_weights
from variants.cache import make_cache
from variants.masks import Masks
from variants.rotary import Rotary

FORMS = ("naive", "absorbed")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """DeepSeek's RMSNorm: in float32, the weight applied in x's dtype."""
    y = x.float()
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


class Unpadded(nn.Linear):
    """The out-projection (E, H * d_v): handed the heads' outputs padded to head_dim (the naive
    form), it drops each head's padding first."""

    def __init__(self, heads: int, head_dim: int, value_dim: int, embed_dim: int, bias: bool):
        super().__init__(heads * value_dim, embed_dim, bias=bias)
        self.heads, self.head_dim, self.value_dim = heads, head_dim, value_dim

    def forward(self, x):  # (B, L, H * D) or (B, L, H * d_v) -> (B, L, E)
        if x.size(-1) != self.in_features:
            B, L, _ = x.shape
            x = x.view(B, L, self.heads, self.head_dim)[..., : self.value_dim].reshape(B, L, -1)
        return super().forward(x)


class LatentAttention(HandWrittenMHA):
    title = "multi-head latent attention"

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        bias: bool = False,
        attention: str = "sdpa",
        merge: str = "view",
        form: str = "naive",
        latent: dict | None = None,
        position_bias: str = "none",
        sinks: bool = False,
        rotary: dict | None = None,
    ):
        if latent is None:
            raise NotImplementedError(
                "LatentAttention is multi-head latent attention: a point with kv_lora_rank > 0"
            )
        if form not in FORMS:
            raise ValueError(f"LatentAttention: form={form!r} is not one of {'|'.join(FORMS)}")
        self.__dict__["spec"] = latent  # before the layers, which read it
        super().__init__(embed_dim, num_heads, bias, attention, merge,
                         position_bias=position_bias, sinks=sinks, rotary=rotary)  # fmt: skip
        self.form = form
        rope = latent["rope"]
        if rotary is not None:  # the rope channels turn: d_r of them, as a d_r-wide head's
            self.rotary = Rotary({**rotary, "fraction": 1.0}, rope)

    def layers(self, embed_dim: int, bias: bool) -> None:
        s, H, D = self.spec, self.num_heads, self.head_dim
        r, n = s["kv_rank"], D - s["rope"]

        def weight(*shape):  # loaded from the state dict (harness/features/latent.py's names)
            return nn.Parameter(torch.zeros(*shape))

        self.kv_down, self.kv_down_norm = weight(r, embed_dim), nn.Parameter(torch.ones(r))
        self.k_up, self.v_up = weight(H * n, r), weight(H * s["value"], r)
        self.k_rope = weight(s["rope"], embed_dim)
        if s["q_rank"]:
            self.q_down, self.q_up = weight(s["q_rank"], embed_dim), weight(embed_dim, s["q_rank"])
            self.q_down_norm = nn.Parameter(torch.ones(s["q_rank"]))
        else:
            self.q_proj = weight(embed_dim, embed_dim)
        self.out_proj = Unpadded(H, D, s["value"], embed_dim, bool(bias))

    def load_hook(self, state_dict, prefix, *args):
        # nn.MHA's in-projection: its query rows where there is no q latent; the rest is zero
        # (the oracle's projection reads the factors); its out-projection without the padding
        w = state_dict.pop(prefix + "in_proj_weight", None)
        state_dict.pop(prefix + "in_proj_bias", None)
        if w is not None and not self.spec["q_rank"]:
            state_dict[prefix + "q_proj"] = w[: self.embed_dim]
        o = state_dict.get(prefix + "out_proj.weight")
        if o is not None and o.size(1) != self.out_proj.in_features:
            E, H, D = self.embed_dim, self.num_heads, self.head_dim
            kept = o.view(E, H, D)[:, :, : self.spec["value"]]  # (E, H, d_v)
            state_dict[prefix + "out_proj.weight"] = kept.reshape(E, -1)

    def latent(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, E) -> c_kv (B, T, r)
        return rms_norm(F.linear(x, self.kv_down), self.kv_down_norm, self.spec["eps"])

    def queries(self, query: torch.Tensor) -> torch.Tensor:  # (B, L, E) -> (B, H, L, D)
        if self.spec["q_rank"]:
            c_q = rms_norm(F.linear(query, self.q_down), self.q_down_norm, self.spec["eps"])
            return self.split_heads(F.linear(c_q, self.q_up))
        return self.split_heads(F.linear(query, self.q_proj))

    def rope_key(self, x: torch.Tensor) -> torch.Tensor:  # (B, S, E) -> (B, 1, S, d_r)
        return F.linear(x, self.k_rope).unsqueeze(1)

    def project(self, query, key, value):
        """The naive form's heads: q (B, H, L, D), k (B, H, S, D), v (B, H, S, D) padded."""
        s, H, D = self.spec, self.num_heads, self.head_dim
        B, S, _ = key.shape
        c_kv = self.latent(key)  # (B, S, r)
        c_v = c_kv if value is key else self.latent(value)
        nope = F.linear(c_kv, self.k_up).view(B, S, H, D - s["rope"]).transpose(1, 2)
        rope = self.rope_key(key).expand(B, H, S, s["rope"])
        v = F.linear(c_v, self.v_up).view(B, S, H, s["value"]).transpose(1, 2)
        v = F.pad(v, (0, D - s["value"]))  # (B, H, S, D): the padding's outputs are dropped
        return self.queries(query), torch.cat([rope, nope], dim=-1), v

    def new_cache(
        self, style: str, batch: int, capacity: int, device, dtype, page_size=None, page_table=None
    ):
        if self.form == "naive":
            return super().new_cache(style, batch, capacity, device, dtype, page_size, page_table)
        paged = {} if style != "paged" else dict(page_size=page_size, page_table=page_table)
        width = self.spec["rope"] + self.spec["kv_rank"]  # [rope key; c_kv], one for the heads
        return make_cache(style, batch, 1, capacity, width, device, dtype, **paged)

    @torch.no_grad()
    def fill_cache(self, kv_cache, x: torch.Tensor) -> None:
        if self.form == "naive":
            return super().fill_cache(kv_cache, x)
        k = self.latent_keys(x, kv_cache.length)
        kv_cache.update(k, k)
        if hasattr(kv_cache, "advance"):
            kv_cache.advance()

    def absorb(self, q_nope: torch.Tensor, k_up: torch.Tensor) -> torch.Tensor:
        """W_UK folded into the queries: q_nope (B, H, L, d_n), k_up (H, d_n, r) -> (B, H, L, r),
        so that q_lat . c_kv = q_nope . (W_UK,h c_kv), the naive form's q_nope . k_nope."""
        return torch.einsum("bhln,hnr->bhlr", q_nope, k_up)

    def attend_folded(self, q, k, key_padding_mask, attn_mask, is_causal):
        """Every head attends to the same keys: the heads are folded into the query rows, one
        head of H * L queries (B, 1, H * L, d_r + r) against k (B, 1, S, d_r + r) and its c_kv
        channels as the values, as FlashMLA decodes (the kernels read each key once, where
        expanded keys cost 10-40x here); the (L, S) mask is tiled over the heads' rows, made
        once per mask (``cached``). -> (B, H, L, r)."""
        B, H, L, width = q.shape
        S = k.size(2)

        def tiled():  # (L, S) -> (H * L, S); (B * H, L, S) -> (B, H * L, S)
            mask = attn_mask
            if mask is None:  # the causal hint: top-left, as the kernels' own
                mask = torch.ones(L, S, dtype=torch.bool, device=q.device).triu(1)
            if mask.dim() == 2:
                return mask.repeat(H, 1)
            return mask.reshape(B, H * L, S)

        mask = None
        if attn_mask is not None or is_causal:
            mask = self.cached("latent_fold", (attn_mask,) if attn_mask is not None else (),
                               (H, L, S, is_causal, q.device), tiled)  # fmt: skip
        masks = Masks(mask, key_padding_mask, causal=False, B=B, H=1, L=H * L, S=S,
                      cache=self.cached)  # fmt: skip
        out = self.kernel.fn(q.reshape(B, 1, H * L, width), k, k[..., self.spec["rope"] :], masks)
        return out.view(B, H, L, -1)

    def latent_keys(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """The absorbed form's keys (B, 1, S, d_r + r): [rotated rope key; c_kv]."""
        rope = self.rope_key(x)
        if self.rotary is not None:
            rope = self.rotary.turn(rope, start)
        return torch.cat([rope, self.latent(x).unsqueeze(1)], dim=-1)

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
        if self.form == "naive":
            return super().forward(query, key, value, key_padding_mask, need_weights, attn_mask,
                                   average_attn_weights, is_causal, kv_cache)  # fmt: skip
        s, H, D = self.spec, self.num_heads, self.head_dim
        d_r, r = s["rope"], s["kv_rank"]
        B, L, _ = query.shape
        start = 0 if kv_cache is None else kv_cache.length
        q = self.queries(query)  # (B, H, L, D): [rope; nope]
        rope_q = q[..., :d_r] if self.rotary is None else self.rotary.turn(q[..., :d_r], start)
        q_lat = self.absorb(q[..., d_r:], self.k_up.view(H, D - d_r, r))  # (B, H, L, r)
        q = torch.cat([rope_q, q_lat], dim=-1) * math.sqrt((d_r + r) / D)  # the scale kept
        k = self.latent_keys(key, start)  # (B, 1, S, d_r + r)
        if kv_cache is not None:
            k, _ = kv_cache.update(k, k)
        if self.slopes is None and self.sinks is None and not need_weights:
            out, weights = self.attend_folded(q, k, key_padding_mask, attn_mask, is_causal), None
        else:  # a head's own bias, sink or weights: every head its keys (a view, no copy)
            k = k.expand(B, H, k.size(2), d_r + r)
            out, weights = self.attend(
                q, k, k[..., d_r:], key_padding_mask, need_weights, attn_mask, is_causal
            )  # fmt: skip
        out = torch.einsum("bhlr,hvr->bhlv", out, self.v_up.view(H, s["value"], r))  # W_UV
        out = self.out_proj(merge_heads(out, self.merge))  # (B, L, E)
        return out, pack_weights(weights, average_attn_weights)
