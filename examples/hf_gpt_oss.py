"""transformers' GptOssAttention: attention sinks (its ``sinks`` parameter), a sliding window,
biases on every projection, grouped K/V heads and YaRN rotary embeddings by its own
GptOssRotaryEmbedding (gpt-oss: rotary_scaling=yarn_untruncated, factor 32); eager, the one
transformers implementation of its sinks here."""

from variants.adapters import DecoderAttention, library_attention, library_rope, whole_heads

GPT_OSS = "transformers.models.gpt_oss.modeling_gpt_oss"


class GptOssMHA(DecoderAttention):
    _supports_ = {"sinks": True, "rotary": "half", "bias": True,
                  "reason": "gpt-oss: a sink per head, half-split rotary, biases"}  # fmt: skip

    def __init__(self, embed_dim, num_heads, bias=True, num_kv_heads=None, window=None,
                 sinks=True, rotary=None):  # fmt: skip
        attn, config = library_attention(
            GPT_OSS, "GptOss", whole_heads(rotary, "gpt-oss"), hidden_size=embed_dim,
            num_attention_heads=num_heads, num_key_value_heads=num_kv_heads or num_heads,
            head_dim=embed_dim // num_heads, sliding_window=window or 128,
            attn_implementation="eager",  # the window itself arrives as nn.MHA's attn_mask
        )  # fmt: skip
        rope = library_rope(GPT_OSS, "GptOss", config, rotary)
        super().__init__(attn, config, (True, True), rope=rope)
