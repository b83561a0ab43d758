"""transformers' MistralAttention: Llama's, with a sliding window (``window``, which the harness
passes to a constructor that names it), no biases, its own rotary embeddings."""

from variants.adapters import DecoderAttention, library_attention, library_rope, whole_heads

MISTRAL = "transformers.models.mistral.modeling_mistral"


class MistralMHA(DecoderAttention):
    _fixed_ = {"bias": False}  # Mistral's projections have none
    _supports_ = {"rotary": ["none", "half"], "reason": "Mistral rotates half-split pairs"}

    def __init__(self, embed_dim, num_heads, bias, num_kv_heads=None, window=None, rotary=None,
                 attn_implementation="sdpa"):  # fmt: skip
        attn, config = library_attention(
            MISTRAL, "Mistral", whole_heads(rotary, "Mistral"), hidden_size=embed_dim,
            num_attention_heads=num_heads, num_key_value_heads=num_kv_heads or num_heads,
            sliding_window=window,  # the window itself arrives as nn.MHA's attn_mask
            attn_implementation=attn_implementation,
        )  # fmt: skip
        rope = library_rope(MISTRAL, "Mistral", config, rotary)
        super().__init__(attn, config, (False, False), rope=rope)
