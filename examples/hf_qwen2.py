"""transformers' Qwen2Attention: biases on the query, key and value projections, none on the
output (the harness's bias=qkv layout), grouped K/V heads."""

from variants.adapters import DecoderAttention, library


class Qwen2MHA(DecoderAttention):
    _fixed_ = {"bias": "qkv"}  # Qwen2's layout, whatever the sweep asks

    def __init__(
        self, embed_dim, num_heads, bias="qkv", num_kv_heads=None, attn_implementation="sdpa"
    ):
        Qwen2Config, Qwen2Attention = library(
            "transformers.models.qwen2.modeling_qwen2", "Qwen2Config", "Qwen2Attention"
        )
        config = Qwen2Config(
            hidden_size=embed_dim,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads or num_heads,
            num_hidden_layers=1,
            attn_implementation=attn_implementation,
        )
        super().__init__(Qwen2Attention(config, layer_idx=0), config, (True, False))
