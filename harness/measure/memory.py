"""Memory a point holds and the process's memory counter, for the leak flag (docs/methodology.md).

``memory_in_use`` reads the allocator's own counter where there is one: CUDA's caching allocator,
glibc's malloc (mallinfo2) on the CPU; the resident set is the last resort.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import os
import sys
import types

import torch

from harness.way.calls import Inputs


def held_bytes(model: torch.nn.Module, inputs: Inputs, grad: bool) -> int:
    """Memory a waiting point holds: its weights and inputs (twice with their gradients), and a
    decode point's KV cache."""
    seen, total = set(), 0
    tensors = [
        *model.parameters(),
        *model.buffers(),
        inputs.query,
        inputs.key,
        inputs.value,
        inputs.grad_out,
        *(v for v in inputs.kwargs.values() if isinstance(v, torch.Tensor)),
    ]
    if inputs.prefix is not None:  # decode: the prefix, and the cache its timed call holds
        tensors.append(inputs.prefix)
        B, P, E = inputs.prefix.shape
        width = getattr(model, "kv_dim", E)  # K/V width; nn.MHA holds the whole sequence
        total += 2 * B * (P + inputs.query.size(1)) * width * inputs.prefix.element_size()
    for t in tensors:
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size() * (2 if grad else 1)
    return total


def reachable_bytes(*roots, limit: int = 50_000) -> int:
    """The bytes of every tensor storage reachable from ``roots`` (a timed call's closure: its
    module with its parameters, gradients and cached masks, the inputs as made for it with the
    masks it is handed, its KV cache), each storage once. ``held_bytes`` counts the inputs before
    they are made for the module: nn.MHA's handed float mask and a kernel's cached ALiBi mask
    (4 GiB each at 8k tokens) were left out of the budget. The walk follows closures, bound
    methods, partials, containers and objects' attributes, never a function's globals or a
    module or class; ``limit`` objects at most."""
    found, seen, stack = {}, set(), list(roots)
    while stack and len(seen) < limit:
        o = stack.pop()
        if id(o) in seen or isinstance(o, (type, types.ModuleType, str, bytes, int, float)):
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            try:
                storage = o.untyped_storage()
                found[storage.data_ptr()] = storage.nbytes()
            except (RuntimeError, NotImplementedError):  # a fake or meta tensor: no storage
                pass
            if o.grad is not None:
                stack.append(o.grad)
            continue
        if isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, (list, tuple, set, frozenset)):
            stack.extend(o)
        elif isinstance(o, types.FunctionType):
            stack.extend(c.cell_contents for c in o.__closure__ or () if _filled(c))
        elif isinstance(o, types.MethodType):
            stack.extend((o.__self__, o.__func__))
        elif isinstance(o, functools.partial):
            stack.extend((o.func, o.args, o.keywords))
        if hasattr(o, "__dict__") and not isinstance(o, types.FunctionType):
            stack.extend(vars(o).values())
        elif isinstance(o, types.FunctionType):
            stack.extend(o.__dict__.values())  # a replay's ``graph``
    return sum(found.values())


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # an empty cell
        return False
    return True


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _malloc_counter():
    """glibc's mallinfo2 (2.33+): bytes malloc has handed out and not had back, every arena and
    mmapped block included. torch's CPU tensors are allocated through it. None where it is absent
    (another libc, or a malloc of its own preloaded: it then reports nothing)."""
    try:
        fn = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _Mallinfo2
    info = fn()
    return fn if info.uordblks + info.hblkhd > 0 else None


_MALLINFO = _malloc_counter() if sys.platform.startswith("linux") else None


def memory_in_use(device: str) -> int | None:
    """Bytes the process holds on ``device``, from the allocator's own counter where there is one:
    CUDA's caching allocator (tensors), glibc's malloc on the CPU. The resident set is the last
    resort: it also grows when malloc keeps freed pages for later, which is not a leak."""
    if device.startswith("cuda"):
        return torch.cuda.memory_allocated(device)
    if _MALLINFO is not None:
        info = _MALLINFO()
        return info.uordblks + info.hblkhd
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None  # not Linux: no leak column


# A leak: memory grew over the point's repetitions by at least LEAK_MB, in at least LEAK_SHARE of
# them (a steady-state call frees what it allocates; one-off growth, such as an allocator taking
# a fresh arena, happens in one repetition, not in most); and it grows again, by at least
# CONFIRM_SHARE as much, when as many calls are made once more after the rounds (what only looked
# like growth, such as caches filling, does not).
LEAK_MB = 1.0
LEAK_SHARE = 0.75
CONFIRM_SHARE = 0.5


def grew_steadily(growth: list[int]) -> bool:
    """The rounds' evidence of a leak (LEAK_MB, LEAK_SHARE) in the bytes each repetition
    gained, before it is confirmed."""
    grew = sum(1 for g in growth if g > 0)
    return len(growth) >= 2 and sum(growth) >= LEAK_MB * 2**20 and grew >= LEAK_SHARE * len(growth)


def regrows(call, before, device: str, calls: int, rounds_growth: int) -> bool:
    """The second measurement of a leak: ``calls`` calls after a garbage collection, with the
    memory read again after another. A leak grows again by about as much as in the rounds
    (CONFIRM_SHARE of ``rounds_growth``). A failure now accuses nobody (it ran in the rounds)."""
    try:
        gc.collect()
        start = memory_in_use(device)
        for _ in range(calls):
            if before:
                before()
            call()
        gc.collect()
        grown = memory_in_use(device) - start
    except (Exception, SystemExit):
        grown = 0
    return grown >= CONFIRM_SHARE * rounds_growth


def leak_columns(growth: list[int], confirmed: bool | None) -> dict:
    """``mem_growth_mb``: net memory gained over the timed repetitions; ``leak``: whether it
    grew steadily and grew again when measured a second time (``confirmed``; empty when that
    second measurement was not made: rounds cut short)."""
    if not growth:
        return {}
    steady = grew_steadily(growth)
    leak = steady and confirmed is True
    if steady and confirmed is None:
        leak = None  # not confirmed, not cleared: the rounds were cut short
    return dict(mem_growth_mb=sum(growth) / 2**20, leak=leak)


def release_memory(device: str) -> None:
    """Give what a failed point held back: collect the cycles its frames may be in, then return
    the caching allocator's free blocks to the driver so that the next point's free-memory check
    and allocations see them."""
    gc.collect()
    if device.startswith("cuda") and torch.cuda.is_available():
        try:
            torch.cuda.empty_cache()
        except RuntimeError:  # a sticky CUDA error fails this too: the worker is replaced
            pass


class call_peak:
    """``with call_peak(device) as peak: call()`` -> ``peak.bytes``: what the call allocated at
    its peak on a CUDA device, above what was allocated before it (its outputs included): what
    a CUDA graph of the call keeps in its pool. 0 elsewhere."""

    def __init__(self, device: str):
        self.device, self.bytes, self._base = device, 0, 0
        self.cuda = device.startswith("cuda") and torch.cuda.is_available()

    def __enter__(self) -> "call_peak":
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda and exc[0] is None:
            torch.cuda.synchronize(self.device)
            self.bytes = max(0, torch.cuda.max_memory_allocated(self.device) - self._base)
