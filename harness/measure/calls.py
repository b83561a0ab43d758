"""The call a point is timed by: forward (no grad) or forward + backward, under its SDPA pin.

Shared by the check's probe, the timing rounds and the profiling pass, so that all three run
exactly the same call.
"""

from __future__ import annotations

import contextlib
import sys

import torch

from harness.check.collect import for_module, rewinder
from harness.inputs import Inputs


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


def timed_call(model, fn, inputs: Inputs, mode: str):
    """The zero-argument callable to time and what to run before each call, untimed: the rewind
    of a module or KV cache that commits what a call appends (``collect.rewinder``), and in
    fwd_bwd clearing the gradients. The call returns the forward's (out, weights): the re-check
    after the rounds compares it with the checked output (harness/check/recheck.py)."""
    inputs = for_module(inputs, model)  # decode: its cache (filled here, untimed), or the sequence
    q, k, v, kwargs, grad_out = (
        inputs.query,
        inputs.key,
        inputs.value,
        inputs.kwargs,
        inputs.grad_out,
    )
    rewind = rewinder(model, kwargs)
    if mode == "fwd":

        def call():
            with torch.no_grad():
                return fn(q, k, v, **kwargs)

        return call, rewind

    leaves = list(inputs.named().values())

    def clear_grads():
        if rewind is not None:
            rewind()
        model.zero_grad(set_to_none=True)
        for t in leaves:
            t.grad = None

    def call():
        result = fn(q, k, v, **kwargs)
        result[0].backward(grad_out)
        return result

    return call, clear_grads


# torch.compile modes whose compiled call replays CUDA graphs (on CUDA, when inductor does not
# skip them).
GRAPH_MODES = ("reduce-overhead", "max-autotune")


def cudagraph_skips() -> int:
    """Inductor's count of graphs it compiled without CUDA graphs although the mode asked for
    them (an input mutated in place, such as a KV cache written at decode; a CPU op); it says so
    in a log line only."""
    if "torch._dynamo" not in sys.modules:
        return 0
    from torch._dynamo.utils import counters

    return counters["inductor"]["cudagraph_skips"]


def replays_graphs(point, skipped: int) -> bool | None:
    """The row's ``cuda_graphs``: whether the timed call replays CUDA graphs (None: its compile
    mode asks for none)."""
    if point.compile not in GRAPH_MODES:
        return None
    return point.device.startswith("cuda") and skipped == 0


def compiled_graphs() -> int:
    if "torch._dynamo" not in sys.modules:  # importing dynamo costs a second; nothing compiled yet
        return 0
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]
