"""torchtune's MultiHeadAttention (grouped K/V heads, a cache written at its own cache_pos)."""

import torch.nn as nn

from variants.adapters import DecoderAttention, PositionCache, library


class TuneMHA(DecoderAttention):
    def __init__(self, embed_dim, num_heads, bias=True, num_kv_heads=None):
        (Attention,) = library("torchtune.modules", "MultiHeadAttention")
        H, Hkv, D = num_heads, num_kv_heads or num_heads, embed_dim // num_heads
        q, k, v, o = (nn.Linear(embed_dim, n * D, bias=bias) for n in (H, Hkv, Hkv, H))
        attn = Attention(embed_dim=embed_dim, num_heads=H, num_kv_heads=Hkv, head_dim=D, q_proj=q,
                         k_proj=k, v_proj=v, output_proj=o)  # fmt: skip
        layout = dict(qkv=("q_proj", "k_proj", "v_proj"), out="output_proj")
        super().__init__(attn, None, (bias, bias), num_heads=H, num_kv_heads=Hkv, head_dim=D,
                         layout=layout, rotary=None)  # fmt: skip

    def new_cache(self, style, batch, capacity, device, dtype):
        self.attn.kv_cache = None  # a new one each time: setup_cache keeps an old one
        self.attn.setup_cache(batch, dtype, capacity)
        cache = self.attn.kv_cache.to(device)  # it writes at its cache_pos: set back on rewinds
        return PositionCache(capacity, rewind_to=lambda n: cache.cache_pos.sub_(cache.size - n))

    def call(self, x, mask, kwargs, kv_cache):  # its mask: bool (B, L, keys), True may attend
        return self.attn(x, x, mask=(mask[:, 0] > float("-inf")).expand(x.size(0), -1, -1)), None
