"""transformers' MistralAttention: Llama's, with a sliding window (``window``, which the harness
passes to a constructor that names it), no biases."""

from variants.adapters import DecoderAttention, library_attention


class MistralMHA(DecoderAttention):
    _fixed_ = {"bias": False}  # Mistral's projections have none

    def __init__(
        self, embed_dim, num_heads, bias, num_kv_heads=None, window=None, attn_implementation="sdpa"
    ):
        attn, config = library_attention(
            "transformers.models.mistral.modeling_mistral",
            "Mistral",
            hidden_size=embed_dim,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads or num_heads,
            sliding_window=window,  # the window itself arrives as nn.MHA's attn_mask
            attn_implementation=attn_implementation,
        )
        super().__init__(attn, config, (False, False))
