"""transformers' Qwen2Attention: biases on the query, key and value projections, none on the
output (the harness's bias=qkv layout), grouped K/V heads, its own rotary embeddings."""

from variants.adapters import DecoderAttention, library_attention, library_rope, whole_heads

QWEN2 = "transformers.models.qwen2.modeling_qwen2"


class Qwen2MHA(DecoderAttention):
    _fixed_ = {"bias": "qkv"}  # Qwen2's layout, whatever the sweep asks
    _supports_ = {"rotary": ["none", "half"], "reason": "Qwen2 rotates half-split pairs"}

    def __init__(self, embed_dim, num_heads, bias="qkv", num_kv_heads=None, rotary=None,
                 attn_implementation="sdpa"):  # fmt: skip
        attn, config = library_attention(
            QWEN2, "Qwen2", whole_heads(rotary, "Qwen2"), hidden_size=embed_dim,
            num_attention_heads=num_heads, num_key_value_heads=num_kv_heads or num_heads,
            attn_implementation=attn_implementation,
        )  # fmt: skip
        rope = library_rope(QWEN2, "Qwen2", config, rotary)
        super().__init__(attn, config, (True, False), rope=rope)
