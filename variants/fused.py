"""One fused nn.Linear(E, E + 2*Hkv*D) for Q, K and V; cross-attention uses the matching weight
slices. Without grouped-query heads (Hkv = H) that is nn.MHA's own (3E, E) in_proj."""

import torch
import torch.nn as nn
import torch.nn.functional as F

from variants._core import HandWrittenMHA


class FusedQKVMHA(HandWrittenMHA):
    title = "one fused QKV projection"

    def layers(self, embed_dim: int, bias: bool) -> None:
        # rows: [Wq; Wk; Wv], (E + 2 * Hkv * D, E)
        self.in_proj = nn.Linear(embed_dim, embed_dim + 2 * self.kv_dim, bias=bias)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)

    def load_hook(self, state_dict, prefix, *args):
        # nn.MHA's [Wq; Wk; Wv] row layout; K and V keep each group's first head (GQA).
        for ours, theirs in (
            ("in_proj.weight", "in_proj_weight"),
            ("in_proj.bias", "in_proj_bias"),
        ):
            if prefix + theirs in state_dict:
                q, k, v = state_dict.pop(prefix + theirs).chunk(3, dim=0)  # 3 x (E, ...)
                state_dict[prefix + ours] = torch.cat([q, self.group(k), self.group(v)])

    def project(self, query, key, value):
        E, Ekv = self.embed_dim, self.kv_dim
        if query is key and key is value:  # self-attention: one (E -> E + 2 Ekv) matmul
            q, k, v = self.in_proj(query).split([E, Ekv, Ekv], dim=-1)  # (B, L, E|Ekv|Ekv)
        else:  # cross-attention: each input meets only its own rows of the fused weight
            w, b = self.in_proj.weight, self.in_proj.bias  # (E + 2 Ekv, E), (E + 2 Ekv,)
            bq, bk, bv = b.split([E, Ekv, Ekv]) if b is not None else (None, None, None)
            q = F.linear(query, w[:E], bq)  # (B, L, E)
            k = F.linear(key, w[E : E + Ekv], bk)  # (B, S, Ekv)
            v = F.linear(value, w[E + Ekv :], bv)  # (B, S, Ekv)
        Hkv = self.num_kv_heads
        return self.split_heads(q), self.split_heads(k, Hkv), self.split_heads(v, Hkv)
