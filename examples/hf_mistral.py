"""transformers' MistralAttention: Llama's, with a sliding window (``window``, which the harness
passes to a constructor that names it), no biases."""

from variants.adapters import DecoderAttention, library


class MistralMHA(DecoderAttention):
    _fixed_ = {"bias": False}  # Mistral's projections have none

    def __init__(
        self,
        embed_dim,
        num_heads,
        bias=False,
        num_kv_heads=None,
        window=None,
        attn_implementation="sdpa",
    ):
        MistralConfig, MistralAttention = library(
            "transformers.models.mistral.modeling_mistral", "MistralConfig", "MistralAttention"
        )
        config = MistralConfig(
            hidden_size=embed_dim,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads or num_heads,
            head_dim=embed_dim // num_heads,
            sliding_window=window,  # the window itself arrives as nn.MHA's attn_mask
            num_hidden_layers=1,
            attn_implementation=attn_implementation,
        )
        super().__init__(MistralAttention(config, layer_idx=0), config, (False, False))
