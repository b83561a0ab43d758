"""Three separate nn.Linear projections for Q, K and V (the textbook way) instead of one in_proj."""

import torch.nn as nn

from variants._core import HandWrittenMHA, split_in_proj


class SeparateProjMHA(HandWrittenMHA):
    title = "three Linear projections"

    def layers(self, embed_dim: int, bias: bool) -> None:
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.k_proj = nn.Linear(embed_dim, self.kv_dim, bias=bias)  # (Hkv * D, E)
        self.v_proj = nn.Linear(embed_dim, self.kv_dim, bias=bias)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)

    def load_hook(self, state_dict, prefix, *args):
        # nn.MHA stores [Wq; Wk; Wv] as one (3E, E) in_proj_weight: hand each Linear its rows
        # (K and V: each group's first head, grouped-query attention).
        if prefix + "in_proj_weight" not in state_dict:
            return
        weights, biases = split_in_proj(state_dict, prefix)
        for i, name in enumerate(("q_proj", "k_proj", "v_proj")):
            keep = (lambda t: t) if name == "q_proj" else self.group
            state_dict[f"{prefix}{name}.weight"] = keep(weights[i])  # (E, E), (Hkv * D, E)
            if biases is not None:
                state_dict[f"{prefix}{name}.bias"] = keep(biases[i])  # (E,), (Hkv * D,)

    def project(self, query, key, value):
        q = self.split_heads(self.q_proj(query))  # (B, L, E) -> (B, H, L, D)
        k = self.split_heads(self.k_proj(key), self.num_kv_heads)  # (B, S, Hkv*D) -> (B, Hkv, S, D)
        v = self.split_heads(
            self.v_proj(value), self.num_kv_heads
        )  # (B, S, Hkv*D) -> (B, Hkv, S, D)
        return q, k, v
