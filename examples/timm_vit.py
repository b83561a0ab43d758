"""timm's ViT Attention: one fused qkv Linear like nn.MHA's, but self-attention only and no
weights returned."""

import inspect

import torch.nn as nn

from variants.masks import merge_masks  # nn.MHA's masks as one additive float mask


def timm_attention() -> type:
    """timm's Attention, imported when a point is built: where timm does not import (a torchvision
    built for another torch raises RuntimeError), each point is `unsupported` with the reason."""
    try:
        from timm.models.vision_transformer import Attention
    except Exception as e:
        raise NotImplementedError(
            f"timm does not import here ({type(e).__name__}: {e}); see docs/guide.md, "
            "'Outside variants and checking a library's attention'"
        ) from e
    return Attention


class TimmViTAttention(nn.Module):
    _supports_ = {
        "cross": False,
        "need_weights": False,
        "reason": "timm's Attention attends one input x to itself and returns no attention weights",
    }

    def __init__(self, embed_dim: int, num_heads: int, bias: bool = True):
        super().__init__()
        Attention = timm_attention()
        if "proj_bias" in inspect.signature(Attention).parameters:
            self.attn = Attention(embed_dim, num_heads=num_heads, qkv_bias=bias, proj_bias=bias)
        elif bias:  # timm releases before proj_bias always give the out projection a bias
            self.attn = Attention(embed_dim, num_heads=num_heads, qkv_bias=True)
        else:
            raise NotImplementedError(
                "bias=False: this timm's Attention has no proj_bias (its out projection "
                "always has a bias); a newer timm has it"
            )
        self.num_heads = num_heads
        self._register_load_state_dict_pre_hook(self.load_hook)

    def load_hook(self, state_dict, prefix, *args):
        # timm splits qkv's output as (B, L, 3, H, D): the same [Wq; Wk; Wv] rows as nn.MHA, so a
        # rename.
        for theirs, ours in (
            ("in_proj_weight", "attn.qkv.weight"),
            ("in_proj_bias", "attn.qkv.bias"),
            ("out_proj.weight", "attn.proj.weight"),
            ("out_proj.bias", "attn.proj.bias"),
        ):
            if prefix + theirs in state_dict:
                state_dict[prefix + ours] = state_dict.pop(prefix + theirs)

    def forward(
        self,
        query,
        key,
        value,
        key_padding_mask=None,
        need_weights=False,
        attn_mask=None,
        average_attn_weights=True,
        is_causal=False,
    ):
        if not (query is key and key is value):
            raise NotImplementedError(
                "cross-attention: timm's Attention attends x to itself (key and value "
                "must be the query tensor)"
            )
        if need_weights:
            raise NotImplementedError(
                "need_weights=True: timm's Attention returns no attention weights"
            )
        if is_causal and key_padding_mask is None:
            # nn.MHA's is_causal says attn_mask is the causal mask: timm's own flag reaches SDPA's
            # causal kernel.
            return self.attn(query, is_causal=True), None  # (B, L, E)
        # timm passes attn_mask to SDPA untouched, where a bool True means MAY attend
        # (nn.MHA: may NOT).
        B, L, _ = query.shape
        # (B|1, 1|H, L, L)
        mask = merge_masks(attn_mask, key_padding_mask, B, self.num_heads, L, L, query.dtype)
        return self.attn(query, attn_mask=mask), None  # (B, L, E)
