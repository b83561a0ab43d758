"""A correct textbook MHA (separate projections, manual softmax), split into small steps so that
each negative control below overrides exactly one step with a real mistake."""

import math

import torch
import torch.nn as nn


class Textbook(nn.Module):
    def __init__(self, embed_dim, num_heads, bias=True):
        super().__init__()
        self.E, self.H, self.D = embed_dim, num_heads, embed_dim // num_heads
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.k_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.v_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self._register_load_state_dict_pre_hook(self.load_hook)

    def load_hook(self, sd, prefix, *args):
        if prefix + "in_proj_weight" not in sd:
            return
        for name, w in zip(
            ("q_proj", "k_proj", "v_proj"), sd.pop(prefix + "in_proj_weight").chunk(3)
        ):
            sd[f"{prefix}{name}.weight"] = w  # (E, E)
        if prefix + "in_proj_bias" in sd:
            for name, b in zip(
                ("q_proj", "k_proj", "v_proj"), sd.pop(prefix + "in_proj_bias").chunk(3)
            ):
                sd[f"{prefix}{name}.bias"] = b  # (E,)

    def project(self, query, key, value):
        return self.q_proj(query), self.k_proj(key), self.v_proj(value)  # (B, L|S, E)

    def scale(self):
        return 1.0 / math.sqrt(self.D)

    def apply_mask(self, scores, mask):  # mask: additive (B|1, 1, L, S), 0 or -inf
        return scores + mask

    def softmax(self, scores):
        return torch.softmax(scores, dim=-1)  # over keys

    def merge(self, out):  # (B, H, L, D) -> (B, L, E)
        B, H, L, D = out.shape
        return out.transpose(1, 2).reshape(B, L, H * D)

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
        B, L, _ = query.shape
        S = key.size(1)
        q, k, v = self.project(query, key, value)
        q = q.view(B, L, self.H, self.D).transpose(1, 2)  # (B, H, L, D)
        k = k.view(B, S, self.H, self.D).transpose(1, 2)  # (B, H, S, D)
        v = v.view(B, S, self.H, self.D).transpose(1, 2)  # (B, H, S, D)
        scores = (q @ k.transpose(-2, -1)) * self.scale()  # (B, H, L, S)
        mask = torch.zeros(1, 1, L, S, dtype=scores.dtype, device=scores.device)
        for m, shape in ((attn_mask, (1, 1, L, S)), (key_padding_mask, (B, 1, 1, S))):
            if m is not None:
                m = (
                    torch.zeros_like(m, dtype=scores.dtype).masked_fill(m, float("-inf"))
                    if m.dtype == torch.bool
                    else m
                )
                mask = mask + m.to(scores.dtype).view(shape)
        if attn_mask is not None or key_padding_mask is not None:
            scores = self.apply_mask(scores, mask)
        weights = self.softmax(scores)  # (B, H, L, S)
        out = self.out_proj(self.merge(weights @ v))  # (B, L, E)
        if not need_weights:
            return out, None
        return out, weights.mean(dim=1) if average_attn_weights else weights
