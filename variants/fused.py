"""One fused nn.Linear(E, 3E) for Q, K and V; cross-attention uses the matching weight slices."""

import torch.nn as nn
import torch.nn.functional as F

from variants._core import HandWrittenMHA


class FusedQKVMHA(HandWrittenMHA):
    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        bias: bool = True,
        attention: str = "sdpa",
        merge: str = "view",
    ):
        super().__init__(embed_dim, num_heads, bias, attention, merge)
        self.in_proj = nn.Linear(embed_dim, 3 * embed_dim, bias=bias)  # rows: [Wq; Wk; Wv]
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self._register_load_state_dict_pre_hook(self.load_hook)

    def load_hook(self, state_dict, prefix, *args):
        # Same [Wq; Wk; Wv] row layout as nn.MHA, so this is only a rename.
        for ours, theirs in (
            ("in_proj.weight", "in_proj_weight"),
            ("in_proj.bias", "in_proj_bias"),
        ):
            if prefix + theirs in state_dict:
                state_dict[prefix + ours] = state_dict.pop(prefix + theirs)

    def project(self, query, key, value):
        E = self.embed_dim
        if query is key and key is value:  # self-attention: one (E -> 3E) matmul
            q, k, v = self.in_proj(query).split(E, dim=-1)  # (B, L, 3E) -> 3 x (B, L, E)
        else:  # cross-attention: each input meets only its own rows of the fused weight
            w, b = self.in_proj.weight, self.in_proj.bias  # (3E, E), (3E,)
            bq, bk, bv = b.split(E) if b is not None else (None, None, None)
            q = F.linear(query, w[:E], bq)  # (B, L, E)
            k = F.linear(key, w[E : 2 * E], bk)  # (B, S, E)
            v = F.linear(value, w[2 * E :], bv)  # (B, S, E)
        return self.split_heads(q), self.split_heads(k), self.split_heads(v)  # (B, H, L|S, D)
