"""What the expression tests compare nn.MultiheadAttention with: attention written out directly in
float64, head by head (tests/test_positions.py, tests/test_sinks.py)."""

import torch.nn as nn


def projected(mha: nn.MultiheadAttention, x, H: int, L: int):
    """nn.MHA's q (B, L, H, D) for the last L positions of x (B, S, E), and k, v (B, S, H, D)."""
    B, S, E = x.shape
    D = E // H
    w, b = mha.in_proj_weight, mha.in_proj_bias
    q = (x[:, S - L :] @ w[:E].T + b[:E]).view(B, L, H, D)
    k = (x @ w[E : 2 * E].T + b[E : 2 * E]).view(B, S, H, D)
    v = (x @ w[2 * E :].T + b[2 * E :]).view(B, S, H, D)
    return q, k, v
