"""transformers' LlamaAttention (grouped K/V heads, rotary embeddings by its own
LlamaRotaryEmbedding, eager or sdpa) behind the variant contract, with the library's own caches
at decode points (variants/adapters.py)."""

from variants.adapters import DecoderAttention, library_attention, library_rope, whole_heads

LLAMA = "transformers.models.llama.modeling_llama"


class LlamaMHA(DecoderAttention):
    _supports_ = {"rotary": ["none", "half"], "reason": "Llama rotates half-split pairs"}

    def __init__(self, embed_dim, num_heads, bias=True, num_kv_heads=None, rotary=None,
                 attn_implementation="sdpa"):  # fmt: skip
        if bias not in (True, False):  # attention_bias is one flag for all four projections
            raise NotImplementedError(f"bias={bias}: Llama's projections all have a bias or none")
        attn, config = library_attention(
            LLAMA, "Llama", whole_heads(rotary, "Llama"), hidden_size=embed_dim,
            num_attention_heads=num_heads, num_key_value_heads=num_kv_heads or num_heads,
            attention_bias=bias, attn_implementation=attn_implementation,
        )  # fmt: skip
        rope = library_rope(LLAMA, "Llama", config, rotary)
        super().__init__(attn, config, (bias, bias), rope=rope)
