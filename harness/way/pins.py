"""What a point pins while it runs: its device (``cuda:N`` made current) and its SDPA backend.
Ground module: used alike by the check, the timing, the probe and the profiling pass."""

from __future__ import annotations

import contextlib

import torch


def use_device(device: str) -> None:
    """Make ``cuda:N`` the current device: CUDA events, graph capture, synchronize and
    ``torch.cuda`` queries without an index act on the current device, GPU 0 unless set, while a
    point's tensors live on GPU N."""
    if device.startswith("cuda:"):
        torch.cuda.set_device(torch.device(device))


def sdpa_context(backend: str):
    """Pin F.scaled_dot_product_attention to one backend (``auto``: let PyTorch choose)."""
    if backend == "auto":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(
        {
            "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION,
            "math": SDPBackend.MATH,
        }[backend]
    )
