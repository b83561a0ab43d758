"""A kernel with one real mistake: nn.MHA's bool padding mask handed to FlexAttention's mask_mod
as it is. There True means "may attend", the opposite of nn.MHA's: each query attends only to
the padded keys. One file, named by ``variant.attention=flex_uninverted`` (variants/kernels/)."""

import torch
from torch.nn.attention.flex_attention import create_block_mask

from variants.kernels import Kernel, flex


def attend(q, k, v, m):  # q (B, H, L, D), k/v (B, H, S, D) -> (B, H, L, D)
    kpm = m.key_padding_mask
    if kpm is None or kpm.dtype != torch.bool:
        return flex.attend(q, k, v, m)

    def mask_mod(b, h, q_idx, kv_idx):
        return kpm[b, kv_idx]  # the mistake: should be ~kpm[b, kv_idx]

    block = m.cached(
        "flex_uninverted",
        lambda: create_block_mask(mask_mod, m.B, None, m.L, m.S, device=q.device),
        str(q.device),
    )
    return flex.flex_function()(q, k, v, block_mask=block)


KERNEL = Kernel(
    name="flex_uninverted", fn=attend, doc="FlexAttention with the padding mask not inverted"
)
