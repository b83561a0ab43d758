"""transformers' GPTNeoXAttention: one ``query_key_value`` Linear whose rows are per head
[H, 3, D] (each head's q, k, v together), ``dense``, partial rotary embeddings by its own
GPTNeoXRotaryEmbedding (``rotary_pct``: the point's rotary_fraction), its cache passed as
``layer_past``, no grouped heads (variants/adapters.py)."""

from variants.adapters import DecoderAttention, library_attention, library_rope

NEOX = "transformers.models.gpt_neox.modeling_gpt_neox"


class GPTNeoXMHA(DecoderAttention):
    _supports_ = {"rotary": ["none", "half"], "reason": "GPT-NeoX rotates half-split pairs"}

    def __init__(self, embed_dim, num_heads, bias=True, rotary=None, attn_implementation="sdpa"):
        if bias not in (True, False):  # attention_bias is one flag for both projections
            raise NotImplementedError(f"bias={bias}: GPT-NeoX's projections have a bias or none")
        attn, config = library_attention(
            NEOX, "GPTNeoX", rotary, hidden_size=embed_dim, num_attention_heads=num_heads,
            attention_bias=bias, attn_implementation=attn_implementation,
        )  # fmt: skip
        layout = dict(qkv="query_key_value", out="dense", order="heads")
        known = dict(num_kv_heads=num_heads, head_dim=embed_dim // num_heads, cache="layer_past")
        rope = library_rope(NEOX, "GPTNeoX", config, rotary)
        super().__init__(attn, config, (bias, bias), layout=layout, rope=rope, **known)
