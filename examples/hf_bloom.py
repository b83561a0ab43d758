"""transformers' BloomAttention: ALiBi by the library's own ``build_alibi_tensor`` (the key's
position only, right under a causal mask), one ``query_key_value`` with rows per head [H, 3, D],
``dense``, its cache as ``layer_past``, a residual added inside (zero here)."""

import torch

from variants.adapters import DecoderAttention, LibraryAlibi, library, library_attention

BLOOM = "transformers.models.bloom.modeling_bloom"


class BloomMHA(DecoderAttention):
    _fixed_ = {"bias": True}  # every projection has one

    def __init__(self, embed_dim, num_heads, bias=True, position_bias="none"):
        attn, config = library_attention(
            BLOOM, "Bloom", hidden_size=embed_dim, n_head=num_heads, attn_implementation="eager"
        )
        layout = dict(qkv="query_key_value", out="dense", order="heads")
        super().__init__(attn, config, num_kv_heads=num_heads, layout=layout,
                         cache="layer_past", rotary=None)  # fmt: skip
        (alibi,) = library(BLOOM, "build_alibi_tensor")  # (B*H, 1, S): the library's own bias
        ones = lambda B, S, dtype, device: alibi(torch.ones(B, S, device=device), num_heads, dtype)  # noqa: E731
        self.alibi = LibraryAlibi(ones, position_bias)

    def call(self, x, mask, kwargs, kv_cache):
        alibi = self.alibi(x.size(0), mask.size(-1), x.dtype, x.device)
        return self.attn(x, x.new_zeros(()), alibi, mask, layer_past=kwargs.get("layer_past"))
