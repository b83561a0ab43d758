"""transformers' GPTNeoXAttention: one ``query_key_value`` Linear whose rows are per head
[H, 3, D] (each head's q, k, v together), ``dense``, rotary embeddings, its cache passed as
``layer_past``, no grouped heads (variants/adapters.py)."""

from variants.adapters import DecoderAttention, library_attention


class GPTNeoXMHA(DecoderAttention):
    def __init__(self, embed_dim, num_heads, bias=True, attn_implementation="sdpa"):
        if bias not in (True, False):  # attention_bias is one flag for both projections
            raise NotImplementedError(f"bias={bias}: GPT-NeoX's projections have a bias or none")
        attn, config = library_attention(
            "transformers.models.gpt_neox.modeling_gpt_neox",
            "GPTNeoX",
            hidden_size=embed_dim,
            num_attention_heads=num_heads,
            attention_bias=bias,
            attn_implementation=attn_implementation,
        )
        layout = dict(qkv="query_key_value", out="dense", order="heads")
        known = dict(num_kv_heads=num_heads, head_dim=embed_dim // num_heads, cache="layer_past")
        super().__init__(attn, config, (bias, bias), layout=layout, **known)
