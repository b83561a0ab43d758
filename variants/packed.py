"""Packed heads: one projection laid out per head as (B, L, H, 3*D), split into q, k, v per head.

nn.MHA's in_proj rows are [Wq; Wk; Wv]; this layout wants, for each head h, [Wq_h; Wk_h; Wv_h].
Loading nn.MHA's weights unpermuted is the classic silent bug: the load hook permutes the rows.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from variants._core import HandWrittenMHA


class PackedHeadsMHA(HandWrittenMHA):
    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        bias: bool = True,
        attention: str = "sdpa",
        merge: str = "view",
    ):
        super().__init__(embed_dim, num_heads, bias, attention, merge)
        self.qkv = nn.Linear(embed_dim, 3 * embed_dim, bias=bias)  # rows: per head [q_h; k_h; v_h]
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self._register_load_state_dict_pre_hook(self.load_hook)

    def to_packed(self, t: torch.Tensor) -> torch.Tensor:
        H, D = self.num_heads, self.head_dim
        # (3E, ...) -> (3, H, D, ...): [Wq; Wk; Wv] per head
        per_head = t.reshape(3, H, D, *t.shape[1:])
        # (H, 3, D, ...) -> (3E, ...): [q_h; k_h; v_h]
        return per_head.transpose(0, 1).reshape(t.shape)

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
        H, D = self.num_heads, self.head_dim
        if query is key and key is value:  # self-attention: one matmul, heads packed together
            qkv = self.qkv(query).view(B, L, H, 3 * D)  # (B, L, 3E) -> (B, L, H, 3D)
            q, k, v = qkv.chunk(3, dim=-1)  # 3 x (B, L, H, D)
            return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, L, D)
        # Cross-attention: pick each input's rows out of the per-head packing.
        w = self.qkv.weight.view(H, 3, D, E)  # (3E, E) -> (H, 3, D, E)
        b = self.qkv.bias.view(H, 3, D) if self.qkv.bias is not None else None  # (3E,) -> (H, 3, D)
        outs = []
        for i, x in enumerate((query, key, value)):
            wi = w[:, i].reshape(E, E)  # (H, D, E) -> (E, E), rows in head order
            bi = b[:, i].reshape(E) if b is not None else None  # (H, D) -> (E,)
            outs.append(self.split_heads(F.linear(x, wi, bi)))  # (B, T, E) -> (B, H, T, D)
        return tuple(outs)
