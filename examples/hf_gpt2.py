"""transformers' GPT2Attention: one Conv1D ``c_attn`` used as x @ W (W (E, 3E), q | k | v) and a
Conv1D ``c_proj``, both with biases, no rotary embeddings, no grouped heads; its caches at decode
points (variants/adapters.py)."""

from variants.adapters import DecoderAttention, library_attention


class GPT2MHA(DecoderAttention):
    _fixed_ = {"bias": True}  # Conv1D always has one

    def __init__(self, embed_dim, num_heads, bias=True, attn_implementation="sdpa"):
        attn, config = library_attention(
            "transformers.models.gpt2.modeling_gpt2",
            "GPT2",
            n_embd=embed_dim,
            n_head=num_heads,
            attn_implementation=attn_implementation,
        )
        layout = dict(qkv="c_attn", out="c_proj", transposed=True)
        super().__init__(attn, config, num_kv_heads=num_heads, layout=layout, rotary=None)
