"""nn.MultiheadAttention fed the projections a model feature transforms (``Transformed``): what the
oracle is where a feature acts between the projections and the scores (rotary embeddings: a
feature's ``qk`` steps, harness/features/).

nn.MHA has no positions, so nothing of it can rotate q and k. ``Transformed`` projects the query,
key and value with nn.MHA's own in-projection weights, hands the heads to the feature's steps
(each ``(m, q, k, v, qpos, kpos) -> (q, k, v)``, the heads (B, H, T, D) and their positions),
and feeds what comes out to nn.MHA's own attention and output projection through an identity
in-projection: its parameters and state dict are nn.MHA's (a variant loads them as ever, and
fwd_bwd's gradients flow back through the projection to nn.MHA's names), and masks, the other
features' terms and returned weights are nn.MHA's as well. Without steps it is nn.MHA itself. The
queries are the last L of the S positions, unless ``positions`` says otherwise (the oracle's
query blocks: harness/way/calls.py, ``collect_in_blocks``).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class Transformed(nn.MultiheadAttention):
    """nn.MHA (batch_first) with ``steps`` (a feature's ``qk`` steps) between its in-projection
    and its attention; ``arguments``: the features' arguments the steps read (``rotary=``)."""

    positioned = True  # takes ``positions=``: collect_in_blocks hands a block's rows theirs

    def __init__(self, embed_dim, num_heads, bias=True, steps=(), projection=None, **arguments):
        super().__init__(embed_dim, num_heads, bias=bias, batch_first=True)
        self.steps = list(steps)
        # a feature's own in-projection, ``(m, query, key, value) -> q, k, v`` (B, T, E) each,
        # from its parameters (latent attention's factors), where nn.MHA's weights state none
        self.projection = projection
        for name, value in arguments.items():
            setattr(self, name, value)
        if self.steps or projection is not None:  # (E, E): q, k and v each passed on as it is
            self.register_buffer("identity", torch.eye(embed_dim), persistent=False)

    def transform(self, q, k, v, qpos, kpos):
        """The steps on the heads: q (B, H, L, D), k and v (B, H, S, D); v may be None."""
        for step in self.steps:
            q, k, v = step(self, q, k, v, qpos, kpos)
        return q, k, v

    def forward(
        self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
        average_attn_weights=True, is_causal=False, positions=None,
    ):  # fmt: skip
        if not self.steps and self.projection is None:
            return super().forward(
                query, key, value, key_padding_mask, need_weights, attn_mask,
                average_attn_weights, is_causal,
            )  # fmt: skip
        E, H = self.embed_dim, self.num_heads
        # nn.MHA's own in-projection function: the oracle in query blocks projects the key and
        # value once for all blocks (harness/way/projection.py wraps it)
        if self.projection is not None:
            q, k, v = self.projection(self, query, key, value)
        else:
            q, k, v = F._in_projection_packed(
                query, key, value, self.in_proj_weight, self.in_proj_bias
            )
        L, S = q.size(1), k.size(1)
        qpos = torch.arange(S - L, S) if positions is None else positions.cpu()

        def heads(x):  # (B, T, E) -> (B, H, T, D)
            return x.view(x.size(0), x.size(1), H, E // H).transpose(1, 2)

        q, k, v = self.transform(heads(q), heads(k), heads(v), qpos, torch.arange(S))
        # back to (T, B, E), the functional's layout, and through identity in-projections
        # (exact: x @ I adds only zeros to x), separate ones so that nothing wraps them
        q, k, v = (x.transpose(1, 2).reshape(x.size(0), x.size(2), E).transpose(0, 1)
                   for x in (q, k, v))  # fmt: skip
        eye = self.identity.to(q.dtype)
        out, weights = F.multi_head_attention_forward(
            q, k, v, E, H, None, None, None, None, self.add_zero_attn, 0.0,
            self.out_proj.weight, self.out_proj.bias, training=self.training,
            key_padding_mask=key_padding_mask, need_weights=need_weights, attn_mask=attn_mask,
            use_separate_proj_weight=True, q_proj_weight=eye, k_proj_weight=eye,
            v_proj_weight=eye, average_attn_weights=average_attn_weights, is_causal=is_causal,
        )  # fmt: skip
        return out.transpose(0, 1), weights
