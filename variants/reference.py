"""nn.MultiheadAttention itself (batch_first=True): the baseline every variant is checked
against."""

import torch.nn as nn


class ReferenceMHA(nn.MultiheadAttention):
    def __init__(self, embed_dim: int, num_heads: int, bias: bool = True):
        super().__init__(embed_dim, num_heads, bias=bias, batch_first=True)
