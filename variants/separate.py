"""Three separate nn.Linear projections for Q, K and V (the textbook way) instead of one in_proj."""

import torch.nn as nn

from variants._core import HandWrittenMHA, split_in_proj


class SeparateProjMHA(HandWrittenMHA):
    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        bias: bool = True,
        attention: str = "sdpa",
        merge: str = "view",
    ):
        super().__init__(embed_dim, num_heads, bias, attention, merge)
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.k_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.v_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self._register_load_state_dict_pre_hook(self.load_hook)

    def load_hook(self, state_dict, prefix, *args):
        # nn.MHA stores [Wq; Wk; Wv] as one (3E, E) in_proj_weight: hand each Linear its rows.
        if prefix + "in_proj_weight" not in state_dict:
            return
        weights, biases = split_in_proj(state_dict, prefix)
        for i, name in enumerate(("q_proj", "k_proj", "v_proj")):
            state_dict[f"{prefix}{name}.weight"] = weights[i]  # (E, E)
            if biases is not None:
                state_dict[f"{prefix}{name}.bias"] = biases[i]  # (E,)

    def project(self, query, key, value):
        q = self.split_heads(self.q_proj(query))  # (B, L, E) -> (B, H, L, D)
        k = self.split_heads(self.k_proj(key))  # (B, S, E) -> (B, H, S, D)
        v = self.split_heads(self.v_proj(value))  # (B, S, E) -> (B, H, S, D)
        return q, k, v
