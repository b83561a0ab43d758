"""One real mistake each, from people's hand-written MHA . Each class is the
textbook implementation with a single step done wrong."""

import math

import torch
from textbook import Textbook

from variants.packed import PackedHeadsMHA


class NoPermute(Textbook):
    """Heads merged straight from (B, H, L, D) to (B, L, E) without moving H back next to D."""

    def merge(self, out):
        B, H, L, D = out.shape
        return out.reshape(B, L, H * D)


class SqrtEmbedDim(Textbook):
    """Scores scaled by 1/sqrt(embed_dim) instead of 1/sqrt(head_dim)."""

    def scale(self):
        return 1.0 / math.sqrt(self.E)


class KVWithQueryWeights(Textbook):
    """Keys and values projected with the query's weights."""

    def project(self, query, key, value):
        return self.q_proj(query), self.q_proj(key), self.q_proj(value)


class MaskNotApplied(Textbook):
    """masked_fill is not in place: the masked scores are computed and thrown away."""

    def apply_mask(self, scores, mask):
        scores.masked_fill(torch.isinf(mask), float("-inf"))
        return scores


class SoftmaxWrongAxis(Textbook):
    """Softmax over the queries (dim=-2) instead of the keys."""

    def softmax(self, scores):
        return torch.softmax(scores, dim=-2)


class BiasDropped(Textbook):
    """Projections built without bias, and nn.MHA's biases silently discarded on load."""

    def __init__(self, embed_dim, num_heads, bias=True):
        super().__init__(embed_dim, num_heads, bias=False)

    def load_hook(self, sd, prefix, *args):
        sd.pop(prefix + "in_proj_bias", None)
        sd.pop(prefix + "out_proj.bias", None)
        super().load_hook(sd, prefix, *args)


class KeyDetached(Textbook):
    """The key projection's output detached: forward is right, no gradient reaches k_proj."""

    def project(self, query, key, value):
        return self.q_proj(query), self.k_proj(key).detach(), self.v_proj(value)


class PackedUnpermuted(PackedHeadsMHA):
    """Packed (B, L, H, 3*D) heads loaded with nn.MHA's [Wq; Wk; Wv] rows as they are."""

    def to_packed(self, t):
        return t
