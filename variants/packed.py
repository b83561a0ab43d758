"""Packed heads: one projection laid out per head as (B, L, H, 3*D), split into q, k, v per head.

nn.MHA's in_proj rows are [Wq; Wk; Wv]; this layout wants, for each head h, [Wq_h; Wk_h; Wv_h].
Loading nn.MHA's weights unpermuted is the classic silent bug: the load hook permutes the rows.
With grouped-query heads (G = H // Hkv query heads per K/V head) the packing is per K/V head g:
[Wq of its G query heads; Wk_g; Wv_g], (B, L, Hkv, (G + 2) * D); G = 1 is the layout above.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from variants._core import HandWrittenMHA


class PackedHeadsMHA(HandWrittenMHA):
    title = "a per-head packed projection"

    def layers(self, embed_dim: int, bias: bool) -> None:
        # rows: per K/V head g, [q_h for its G heads; k_g; v_g]: (Hkv * (G + 2) * D, E)
        self.qkv = nn.Linear(embed_dim, embed_dim + 2 * self.kv_dim, bias=bias)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)

    def to_packed(self, t: torch.Tensor) -> torch.Tensor:
        Hkv, G, D = self.num_kv_heads, self.groups, self.head_dim
        q, k, v = t.chunk(3, dim=0)  # nn.MHA's [Wq; Wk; Wv]: 3 x (E, ...)
        q = q.reshape(Hkv, G, D, *t.shape[1:])  # (Hkv, G, D, ...): head h = g * G + j
        k = self.group(k).reshape(Hkv, 1, D, *t.shape[1:])  # (Hkv, 1, D, ...)
        v = self.group(v).reshape(Hkv, 1, D, *t.shape[1:])
        return torch.cat([q, k, v], dim=1).reshape(-1, *t.shape[1:])  # (Hkv * (G + 2) * D, ...)

    def load_hook(self, state_dict, prefix, *args):
        if prefix + "in_proj_weight" in state_dict:
            state_dict[prefix + "qkv.weight"] = self.to_packed(
                state_dict.pop(prefix + "in_proj_weight")
            )
        if prefix + "in_proj_bias" in state_dict:
            state_dict[prefix + "qkv.bias"] = self.to_packed(
                state_dict.pop(prefix + "in_proj_bias")
            )

    def project(self, query, key, value):
        B, L, E = query.shape
        H, Hkv, G, D = self.num_heads, self.num_kv_heads, self.groups, self.head_dim
        if query is key and key is value:  # self-attention: one matmul, heads packed together
            qkv = self.qkv(query).view(B, L, Hkv, G + 2, D)  # (B, L, E + 2 Ekv) -> per K/V head
            q = qkv[:, :, :, :G].reshape(B, L, H, D)  # (B, L, Hkv, G, D) -> (B, L, H, D)
            k, v = qkv[:, :, :, G], qkv[:, :, :, G + 1]  # 2 x (B, L, Hkv, D)
            return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H|Hkv, L, D)
        # Cross-attention: pick each input's rows out of the per-head packing.
        w = self.qkv.weight.view(Hkv, G + 2, D, E)  # (Hkv * (G + 2) * D, E) -> (Hkv, G + 2, D, E)
        b = self.qkv.bias.view(Hkv, G + 2, D) if self.qkv.bias is not None else None
        rows = (slice(0, G), slice(G, G + 1), slice(G + 1, G + 2))  # q heads, k_g, v_g
        outs = []
        for x, part, heads in zip((query, key, value), rows, (H, Hkv, Hkv)):
            wi = w[:, part].reshape(heads * D, E)  # rows in head order
            bi = b[:, part].reshape(heads * D) if b is not None else None
            outs.append(self.split_heads(F.linear(x, wi, bi), heads))  # (B, T, heads, D) ...
        return tuple(outs)  # (B, H, L, D), (B, Hkv, S, D), (B, Hkv, S, D)
