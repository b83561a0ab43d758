"""nn.MultiheadAttention itself (batch_first=True): the baseline every variant is checked
against.

nn.MHA has no grouped K/V heads and no KV cache. At a grouped-query point (num_kv_heads <
num_heads) it holds the grouped model's weights with each K/V head repeated for its group (the
same math, H K/V heads computed); at a decode point it attends from the new tokens to the whole
sequence, recomputing the cached tokens' keys and values (its row's kv_cache column: none). With
QK-norm or rotary embeddings it is nn.MHA fed the normed and rotated projections, with latent
attention the projections of its factors, as the oracle is (harness/way/transformed.py)."""

import torch
import torch.nn as nn

from harness.features import latent as mla
from harness.features.qk_norm import qk_norm as norm
from harness.features.rotary import rotary as rotate
from harness.way.transformed import Transformed


class ReferenceMHA(Transformed):
    title = "nn.MultiheadAttention"  # how findings name it (a run's ways.json)
    # No cache to hold two ways: its decode points run once, at kv_cache=static (row: none).
    _supports_ = {
        "kv_cache": "static",
        "reason": "nn.MultiheadAttention has no KV cache: it recomputes the cached tokens' keys "
        "and values in every step, once per decode point (its kv_cache=static row, which says "
        "kv_cache=none)",
    }

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        bias: bool = True,
        num_kv_heads: int | None = None,
        sinks: bool = False,
        rotary: dict | None = None,
        qk_norm: dict | None = None,
        latent: dict | None = None,
    ):
        # qk_norm, rotary: the oracle's own steps between the projections and the scores (in
        # that order), latent: its projection from the factors, so that the baseline is timed as
        # nn.MHA handed the same model; without them nn.MHA itself.
        steps = ((norm,) if qk_norm else ()) + ((rotate,) if rotary else ())
        arguments = {
            k: v for k, v in dict(rotary=rotary, qk_norm=qk_norm, latent=latent).items() if v
        }
        projection = mla.project if latent else None
        super().__init__(embed_dim, num_heads, bias, steps, projection, **arguments)
        for name, shape in (mla.shapes(latent, embed_dim, num_heads) if latent else {}).items():
            self.register_parameter(name, nn.Parameter(torch.zeros(shape)))  # from the state dict
        if qk_norm is not None:  # its weights, from the state dict as the oracle's
            size = embed_dim // num_heads if qk_norm["over"] == "head" else embed_dim
            self.q_norm = nn.Parameter(torch.ones(size))
            self.k_norm = nn.Parameter(torch.ones(size))
        # sinks: nn.MHA's zero key (add_zero_attn) and H logits the harness hands it in its
        # float mask, -s_h on every real key (harness/features/sinks.py); from the state dict.
        self.add_zero_attn = sinks
        if sinks:
            self.sinks = nn.Parameter(torch.zeros(num_heads))
