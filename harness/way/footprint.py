"""How much memory a point needs at least, known before anything is built.

A point too large for the machine should be ``oom`` with the figures, at once: allocating it
would take minutes of swapping, or bring the kernel's OOM killer (which the worker survives,
but slowly). The estimate is a lower bound, so that a point that could fit is never refused:
it counts the tensors every correct implementation must hold during the check, which runs
three models on the same inputs (the float64 oracle on the CPU, nn.MultiheadAttention and the
variant in the point's dtype on its device).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from harness import features
from harness.way import capabilities
from harness.config import Point

MODE_FACTOR = {"fwd": 1, "fwd_bwd": 3}  # fwd_bwd keeps activations for backward and their gradients


class TooLarge(MemoryError):
    """The point cannot fit; recorded as ``oom`` (harness.errors.classify) with the estimate."""


@dataclass(frozen=True)
class Footprint:
    inputs: int  # elements: query, key/value when cross, grad_out in fwd_bwd
    weights: int  # in/out projections and biases
    activations: int  # q, k, v, the attention output and the output
    scores: int  # B x H x L x S, twice (scores, probabilities), where the path materialises them

    def bytes(self, itemsize: int, mode: str) -> int:
        return itemsize * (
            self.inputs + self.weights + MODE_FACTOR[mode] * (self.activations + self.scores)
        )


def materialises_scores(point: Point, kernel=None) -> bool:
    """Paths that hold the L x S scores: returned weights, a kernel that declares it holds
    them (``Kernel.scores``: the hand-written manual softmax), and an SDPA kernel (one whose op
    names the backend that ran) pinned to SDPA's math path. ``kernel``: the one the point's
    variant runs (``capabilities.apply`` found it), or None."""
    if kernel is None:
        return point.need_weights
    math = point.sdpa_backend == "math" and not kernel.names_itself
    return point.need_weights or kernel.scores or math


def scores_of(point: Point) -> bool:
    """``materialises_scores`` of a point not yet admitted: its kernel looked up."""
    return materialises_scores(point, capabilities.apply(point).kernel)


def footprint(point: Point, scores: bool, grouped: bool = True) -> Footprint:
    """``grouped``: K and V as the variant holds them, Hkv heads wide (nn.MHA and the oracle hold
    every head: False). A decode point's prefix is an input."""
    B, L, S, E, H = point.batch, point.seq_len, point.kv_seq_len, point.embed_dim, point.num_heads
    Ekv = E * point.num_kv_heads // H if grouped else E  # K/V width
    kv = 2 * B * S * E if point.cross else 0
    prefix = B * (point.kv_cache_len or 0) * E
    return Footprint(
        inputs=B * L * E + kv + prefix + (B * L * E if point.mode == "fwd_bwd" else 0),
        weights=2 * E * E + 2 * E * Ekv + 2 * E + 2 * Ekv,
        activations=B * L * E + 2 * B * S * Ekv + 2 * B * L * E,
        scores=2 * B * H * L * S if scores else 0,
    )


def handed_elements(point: Point) -> int:
    """The float (B*H, L, S) masks nn.MHA is handed for the point's model features (it has no
    argument for them: ALiBi's bias; a sink's mask and ``add_zero_attn``'s copy of it padded by
    the zero key): 4.3 GB each in bfloat16 at B=1, H=32, L=8192. The float64 oracle takes them a
    block at a time."""
    masks = max((f.handed for f in features.active(point)), default=0)
    return point.batch * point.num_heads * point.seq_len * point.kv_seq_len * masks


def available_bytes(device: str) -> int | None:
    """Free memory on ``device`` now: on CUDA the driver's free bytes plus what PyTorch's caching
    allocator has reserved but holds no tensor in (it reuses that before asking the driver; left
    out, one large point made later ones falsely ``oom``); the CPU's MemAvailable."""
    if device.startswith("cuda"):
        dev = torch.device(device)
        cached = torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
        return torch.cuda.mem_get_info(dev)[0] + max(0, cached)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None  # unknown: no refusal


def _gib(n: float) -> str:
    return f"{n / 2**30:.3g} GiB"


def estimate(point: Point, scores: bool) -> dict[str, int]:
    """Bytes needed at least, per memory: {"cpu": ..., "cuda:0": ...}; ``scores``: the
    variant's path holds the L x S scores (``materialises_scores``)."""
    item = torch.empty(0, dtype=point.torch_dtype).element_size()
    own = footprint(point, scores).bytes(item, point.mode)
    own += item * sum(f.held(point) for f in features.active(point))  # a paged cache's pool
    # nn.MHA: weights only when asked; what it is handed for a model feature (calls.handed)
    ref = footprint(point, point.need_weights, grouped=False).bytes(item, point.mode)
    ref += item * handed_elements(point)
    # float64, on the CPU
    oracle = footprint(point, point.need_weights, grouped=False).bytes(8, point.mode)
    if point.device == "cpu":
        return {"cpu": oracle + own + ref}
    return {"cpu": oracle, point.device: own + ref}


def check_fits(point: Point, scores: bool) -> int:
    """Raise ``TooLarge`` when the point cannot fit; return its estimate on its device (bytes).
    ``scores``: as ``estimate``."""
    needs = estimate(point, scores)
    for device, need in needs.items():
        free = available_bytes(device)
        if free is not None and need > free:
            f = footprint(point, scores)
            raise TooLarge(
                f"out of memory before allocating: needs at least {_gib(need)} on {device} "
                f"({f.inputs:.3g} input, {f.activations:.3g} activation"
                + (f", {f.scores:.3g} score" if f.scores else "")
                + " elements per model"
                + (", x3 for fwd_bwd" if point.mode == "fwd_bwd" else "")
                + f"; the check runs the variant, nn.MHA and a float64 oracle), {_gib(free)} free"
            )
    return needs[point.device]
