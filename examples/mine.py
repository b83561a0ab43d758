"""Multi-head attention written from scratch with no biases: separate Q, K, V weights."""

import math

import torch
import torch.nn as nn


def additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """nn.MHA's masks as a float to add to the scores: bool True means "may not attend"."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
            mask, float("-inf")
        )
    return mask.to(dtype)


class MyAttention(nn.Module):
    def __init__(self, embed_dim: int, num_heads: int, bias: bool = False):
        super().__init__()
        if bias:  # a case this module cannot do: the harness records `unsupported`
            raise NotImplementedError("MyAttention has no biases")
        if embed_dim % num_heads:  # a bad option: the harness records `invalid`
            raise ValueError(f"embed_dim={embed_dim} is not divisible by num_heads={num_heads}")
        self.num_heads = num_heads
        self.q, self.k, self.v, self.out = (
            nn.Linear(embed_dim, embed_dim, bias=False) for _ in range(4)
        )
        self._register_load_state_dict_pre_hook(self.load_hook)

    def load_hook(self, state_dict, prefix, *args):
        # nn.MHA keeps Q, K and V as row blocks of one weight: in_proj_weight (3E, E) = [Wq; Wk; Wv]
        wq, wk, wv = state_dict.pop(prefix + "in_proj_weight").chunk(3)  # 3 x (E, E)
        state_dict.update(
            {
                prefix + "q.weight": wq,
                prefix + "k.weight": wk,
                prefix + "v.weight": wv,
                prefix + "out.weight": state_dict.pop(prefix + "out_proj.weight"),
            }
        )

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
    ):
        B, L, E = query.shape
        S, H = key.shape[1], self.num_heads
        q = self.q(query).view(B, L, H, E // H).transpose(1, 2)  # (B, L, E) -> (B, H, L, D)
        k = self.k(key).view(B, S, H, E // H).transpose(1, 2)  # (B, S, E) -> (B, H, S, D)
        v = self.v(value).view(B, S, H, E // H).transpose(1, 2)  # (B, S, E) -> (B, H, S, D)
        scores = q @ k.transpose(-2, -1) / math.sqrt(E // H)  # (B, H, L, S)
        if attn_mask is not None:  # nn.MHA applies it whether or not is_causal is set
            mask = additive(attn_mask, scores.dtype)  # (L, S) or (B*H, L, S)
            scores = scores + (mask.view(B, H, L, S) if mask.dim() == 3 else mask)
        if key_padding_mask is not None:
            # (B, S) -> (B, 1, 1, S)
            scores = scores + additive(key_padding_mask, scores.dtype).view(B, 1, 1, S)
        weights = scores.softmax(dim=-1)  # (B, H, L, S)
        # (B, H, L, D) -> (B, L, H, D) -> (B, L, E)
        out = (weights @ v).transpose(1, 2).reshape(B, L, E)
        if not need_weights:
            return self.out(out), None
        return self.out(out), weights.mean(dim=1) if average_attn_weights else weights
