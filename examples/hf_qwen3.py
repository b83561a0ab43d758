"""transformers' Qwen3Attention: QK-norm (its q_norm and k_norm, RMSNorm over each head's
channels before the rotation), grouped K/V heads, no biases, its own rotary embeddings."""

from variants.adapters import DecoderAttention, library_attention, library_rope, whole_heads

QWEN3 = "transformers.models.qwen3.modeling_qwen3"


class Qwen3MHA(DecoderAttention):
    _fixed_ = {"bias": False}  # attention_bias=False in every Qwen3
    _supports_ = {"qk_norm": "head", "rotary": ["none", "half"],
                  "reason": "Qwen3 norms each head's q and k, turns half-split pairs"}  # fmt: skip

    def __init__(self, embed_dim, num_heads, bias=False, num_kv_heads=None, rotary=None,
                 qk_norm=None, attn_implementation="sdpa"):  # fmt: skip
        attn, config = library_attention(
            QWEN3, "Qwen3", whole_heads(rotary, "Qwen3"), hidden_size=embed_dim,
            num_attention_heads=num_heads, num_key_value_heads=num_kv_heads or num_heads,
            head_dim=embed_dim // num_heads, rms_norm_eps=(qk_norm or {}).get("eps", 1e-6),
            attn_implementation=attn_implementation,
        )  # fmt: skip
        rope = library_rope(QWEN3, "Qwen3", config, rotary)
        super().__init__(attn, config, (False, False), rope=rope)
