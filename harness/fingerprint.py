"""What torch looked like when the worker started, and whether a point changed it.

Points share a worker process (harness/sweep/worker.py), and a variant is arbitrary code: one that
wraps nn.MultiheadAttention.forward or replaces F.scaled_dot_product_attention on import (as some
libraries do) would change every later point's check and time. So the worker takes a
``Fingerprint`` at its start: the identity of every function and class in the namespaces the
harness and nn.MultiheadAttention call through (``WATCHED``). What a variant changes (on import,
as a library that patches torch does, or in its calls) becomes its ``World``: in place for its
own calls only, torch put back as found for everyone else's (harness/sweep/serve.py), and its
rows name it (``torch_changed``). Meanwhile the yardsticks are computed with torch as found
(``as_found``): the patched names put back for the computation, the point's own put back after.

Only names present at the start are compared, and only by identity: torch adds names lazily
(submodules, compiled helpers), which is no change to what was there. Torch also rewraps a few of
its own on first use (importing torch._dynamo wraps torch.manual_seed; the first torch.compile,
nn.Module.__init__): a replacement whose code lives in torch's own package is torch's, not a
point's (``_torch_own``).

Ground module: imports torch, nothing of the harness.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import sysconfig
import threading
import time
from typing import Callable, Iterator

import torch

from harness import processes

_MISSING = object()
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_STDLIB_DIR = sysconfig.get_paths()["stdlib"] + os.sep


def _watched() -> list[tuple[str, object]]:
    """(name, namespace) pairs whose attributes are compared: torch's functions, the Tensor's
    methods, nn.functional, nn.MultiheadAttention and the modules it is built from, the attention
    kernels' modules once imported, the CUDA timing API and the clocks the rounds read."""
    import torch.nn.functional as F

    spaces: list[tuple[str, object]] = [
        ("torch", torch),
        ("torch.Tensor", torch.Tensor),
        ("torch._C.TensorBase", torch._C.TensorBase),
        ("torch.nn", torch.nn),
        ("torch.nn.functional", F),
        ("torch.nn.MultiheadAttention", torch.nn.MultiheadAttention),
        ("torch.nn.Linear", torch.nn.Linear),
        ("torch.nn.Module", torch.nn.Module),
        ("torch.cuda", torch.cuda),
        ("torch.cuda.Event", torch.cuda.Event),
        ("time", time),
    ]
    for name in ("torch.nn.attention", "torch.nn.attention.flex_attention"):
        module = sys.modules.get(name)
        if module is not None:
            spaces.append((name, module))
    return spaces


def _torch_own(value) -> bool:
    """A replacement torch made itself: its code is in torch's package (functools.wraps copies
    ``__module__``, not the code's file, so a point's wrapper is not mistaken for torch's)."""
    code = getattr(value, "__code__", None)
    if code is not None:
        return code.co_filename.startswith(_TORCH_DIR)
    return value is not _MISSING and str(getattr(value, "__module__", "")).startswith("torch")


def _worth_watching(value) -> bool:
    return callable(value) and not isinstance(value, type(sys))  # functions and classes


def _switch(path: str, attr: str) -> tuple[str, Callable[[], object], Callable[[object], None]]:
    """A backend flag (``torch.backends.cudnn``'s ``allow_tf32``) as (name, read, set)."""
    owner = functools.reduce(getattr, path.split(".")[1:], torch)
    return f"{path}.{attr}", lambda: getattr(owner, attr), lambda v: setattr(owner, attr, v)


# torch's global switches that change a later point's numbers or time, as (name, read, set).
# Measured (issue 74): float32 matmul precision "medium" in one variant's constructor moved
# ``fused`` from 0.83x to 1.14x nn.MHA at every later point of the worker; anomaly mode made every
# later latency 11.7x. Threads, manual_seed and flush-denormal were checked and do not leak (the
# harness sets threads per point and seeds per point). CUDA matmul's allow_tf32 is the matmul
# precision's (setting one sets the other; restoring both mixes torch's two APIs, which it refuses).
STATE: tuple[tuple[str, Callable[[], object], Callable[[object], None]], ...] = (
    ("torch.float32_matmul_precision", torch.get_float32_matmul_precision,
     torch.set_float32_matmul_precision),
    ("torch.autograd.anomaly_mode",
     lambda: (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()),
     lambda v: torch.set_anomaly_enabled(*v)),
    ("torch.grad_enabled", torch.is_grad_enabled, torch.set_grad_enabled),
    ("torch.default_dtype", torch.get_default_dtype, torch.set_default_dtype),
    ("torch.deterministic_algorithms",
     lambda: (torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled()),
     lambda v: torch.use_deterministic_algorithms(v[0], warn_only=v[1])),
    _switch("torch.backends.cuda.matmul", "allow_fp16_reduced_precision_reduction"),
    _switch("torch.backends.cuda.matmul", "allow_bf16_reduced_precision_reduction"),
    _switch("torch.backends.cudnn", "allow_tf32"),
    _switch("torch.backends.cudnn", "benchmark"),
    _switch("torch.backends.cudnn", "deterministic"),
    _switch("torch.backends.mkldnn", "enabled"),
)  # fmt: skip


def _state() -> dict[str, object]:
    """Each ``STATE`` switch's value now (one this torch cannot read is left out)."""
    out = {}
    for name, read, _ in STATE:
        try:
            out[name] = read()
        except Exception:  # noqa: BLE001 (a switch this build lacks)
            continue
    return out


def _set_state(name: str, value) -> None:
    for known, _, set_ in STATE:
        if known == name:
            set_(value)


def _shown(value) -> str:
    if isinstance(value, tuple):
        return "/".join(map(str, value))
    return str(value).removeprefix("torch.")


def _own_thread(thread: threading.Thread) -> bool:
    """A thread torch or Python's library started (a compile worker's pool, the profiler), not a
    variant: its target's code is in torch's package or the standard library's."""
    target = getattr(thread, "_target", None) or getattr(type(thread), "run", None)
    code = getattr(target, "__code__", None) or getattr(getattr(target, "__func__", None),
                                                       "__code__", None)  # fmt: skip
    if code is None:
        return True  # nothing to tell by: not accused
    return code.co_filename.startswith((_TORCH_DIR, _STDLIB_DIR))


class Fingerprint:
    """The identity of every watched name at one moment (``take``), torch's global switches
    (``STATE``) and the threads then alive."""

    def __init__(self, objects: dict[tuple[str, str], object], spaces: dict[str, object]):
        self._objects = objects  # (namespace, attribute) -> the object found
        self._spaces = spaces
        self._state = _state()
        self._threads = set(threading.enumerate())
        self._children = processes.started()

    @classmethod
    def take(cls) -> "Fingerprint":
        objects, spaces = {}, {}
        for name, space in _watched():
            spaces[name] = space
            for attr, value in list(vars(space).items()):
                if _worth_watching(value):
                    objects[(name, attr)] = value
        return cls(objects, spaces)

    def _state_differing(self) -> Iterator[tuple[str, object, object]]:
        """(switch, value at take, value now) where a point flipped one of torch's switches."""
        now = _state()
        for name, value in self._state.items():
            if name in now and now[name] != value:
                yield name, value, now[name]

    def new_threads(self) -> list[str]:
        """Threads alive now that were not at ``take`` and that neither torch nor Python's
        library started: a variant's (a daemon spinning in Python holds the GIL and timed the
        next points 500x slow with their rows clean)."""
        return sorted(
            t.name
            for t in threading.enumerate()
            if t not in self._threads and t.is_alive() and not _own_thread(t)
        )

    def new_processes(self) -> list[str]:
        """Child processes alive now that were not at ``take`` (torch's compile pool aside),
        "pid (command)": a variant's, running beside every later call (one that called
        ``setsid`` is out of the worker's process group: the worker's kill ends it by its
        mark, harness/processes.py)."""
        new = processes.started() - self._children
        return [f"{pid} ({processes.command(pid)})" for pid in sorted(new)]

    def _now(self, name: str, attr: str):
        return vars(self._spaces[name]).get(attr, _MISSING)

    def _differing(self) -> Iterator[tuple[str, str, object, object]]:
        """(namespace, attribute, value at take, value now) where a point changed it."""
        spaces = {name: vars(space) for name, space in self._spaces.items()}  # once: ~1 ms less
        for (name, attr), value in self._objects.items():
            now = spaces[name].get(attr, _MISSING)
            if now is not value and not _torch_own(now):
                yield name, attr, value, now

    def changed(self) -> list[str]:
        """What differs from the fingerprint, as dotted names (empty: nothing)."""
        return [f"{name}.{attr}" for name, attr, _, _ in self._differing()] + [
            f"{name}={_shown(now)}" for name, _, now in self._state_differing()
        ]

    @contextlib.contextmanager
    def as_found(self) -> Iterator[None]:
        """Inside the block, every watched name is what it was at ``take``; after it, whatever
        it had become."""
        swapped = []
        for name, attr, value, now in list(self._differing()):
            swapped.append((self._spaces[name], attr, now))
            setattr(self._spaces[name], attr, value)
        try:
            yield
        finally:
            for space, attr, now in reversed(swapped):
                if now is _MISSING:
                    delattr(space, attr)
                else:
                    setattr(space, attr, now)


class World:
    """What one variant class changed of torch (on import, as a library that patches torch does,
    in its constructor or in its calls: torch's functions and its global switches, ``STATE``):
    its world, applied to its own calls only (a module's import is the world of the class whose
    point imported it first). ``entered`` puts the world's
    replacements in place for the block (its build, check and profile; each of its repetitions
    and its re-check); at the block's end whatever differs from the fingerprint joins the world
    and torch is put back as the worker found it, so that nn.MultiheadAttention's calls (the
    oracle's, the reference's in the same rounds) and the next point's never run it. Issue 73:
    litgpt, whose lightning import replaces ``torch.compile``, was marked ``unsupported`` at every
    point and its worker replaced each time."""

    def __init__(self, fingerprint: Fingerprint):
        self._fingerprint = fingerprint
        self._patches: dict[tuple[str, str], object] = {}  # (namespace, attribute) -> its own
        self._state: dict[str, object] = {}  # switch -> its value (``STATE``)

    @property
    def names(self) -> list[str]:
        """The world's replacements as dotted names, its switches as name=value (empty: it
        changed nothing)."""
        return [f"{name}.{attr}" for name, attr in self._patches] + [
            f"{name}={_shown(value)}" for name, value in self._state.items()
        ]

    @contextlib.contextmanager
    def entered(self) -> Iterator[None]:
        fp = self._fingerprint
        for (name, attr), value in self._patches.items():
            setattr(fp._spaces[name], attr, value)
        for name, value in self._state.items():
            _set_state(name, value)
        try:
            yield
        finally:
            for name, attr, value, now in list(fp._differing()):
                self._patches[(name, attr)] = now  # what it changed joins its world
                setattr(fp._spaces[name], attr, value)  # torch as found, for everyone else
            for name, value, now in list(fp._state_differing()):
                self._state[name] = now
                _set_state(name, value)



def said(names: list[str], limit: int = 3) -> str:
    """``torch.nn.MultiheadAttention.forward and 2 more``: what a row says it changed."""
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
