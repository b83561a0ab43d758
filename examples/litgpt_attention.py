"""litgpt's CausalSelfAttention (one fused qkv, grouped K/V heads, rotary, a cache it writes at
input_pos) behind the variant contract: the call hook and a PositionCache (variants/adapters.py)."""

from variants.adapters import DecoderAttention, PositionCache, identity_rotary, library


class LitGPTMHA(DecoderAttention):
    def __init__(self, embed_dim, num_heads, bias=True, num_kv_heads=None):
        Config, Attention = library("litgpt.model", "Config", "CausalSelfAttention")
        Hkv = num_kv_heads or num_heads
        config = Config(n_embd=embed_dim, n_head=num_heads, n_query_groups=Hkv, bias=bias,
                        rotary_percentage=1.0, block_size=1 << 16)  # fmt: skip
        D = config.head_size
        super().__init__(Attention(config, 0), None, (bias, bias), num_heads=num_heads,
                         num_kv_heads=config.n_query_groups, head_dim=D,
                         layout=dict(qkv="qkv", out="proj"), rotary=None)  # fmt: skip

    def new_cache(self, style, batch, capacity, device, dtype):
        self.attn.kv_cache = self.attn.build_kv_cache(batch, capacity, None, device, dtype)
        return PositionCache(capacity)

    def call(self, x, mask, kwargs, kv_cache):
        at = None if kv_cache is None else kv_cache.positions(x.size(1), x.device)
        return self.attn(x, *identity_rotary(x, self.head_dim), mask, at), None
