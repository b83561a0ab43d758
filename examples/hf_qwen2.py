"""transformers' Qwen2Attention: biases on the query, key and value projections, none on the
output (the harness's bias=qkv layout), grouped K/V heads."""

from variants.adapters import DecoderAttention, library_attention


class Qwen2MHA(DecoderAttention):
    _fixed_ = {"bias": "qkv"}  # Qwen2's layout, whatever the sweep asks

    def __init__(
        self, embed_dim, num_heads, bias="qkv", num_kv_heads=None, attn_implementation="sdpa"
    ):
        attn, config = library_attention(
            "transformers.models.qwen2.modeling_qwen2",
            "Qwen2",
            hidden_size=embed_dim,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads or num_heads,
            attn_implementation=attn_implementation,
        )
        super().__init__(attn, config, (True, False))
