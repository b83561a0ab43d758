"""nn.MultiheadAttention called block after block on the same key and value, its key and value
projected once (``keys_projected_once``): the oracle in query blocks (harness/way/calls.py,
``collect_in_blocks``) at long sequences.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F


@contextlib.contextmanager
def keys_projected_once(backward: bool = False):
    """nn.MultiheadAttention called block after block on the same key and value projects them
    once: its in-projection (``F._in_projection_packed``, which nn.MHA's own forward calls) is
    wrapped so that a block reuses the key and value projections of the first block and projects
    only its own query rows, as nn.MHA does. Without it each block re-projected the whole key
    and value: 3.6e13 FLOP for one sweep=llm prefill oracle (B=1, L=8192, E=4096) instead of
    2.2e12 (docs/architecture.md, Known traps: the oracle in query blocks).

    With grad, only where the caller promises ``backward``: that it back-propagates every block's
    output before the context ends. The blocks then share leaves cut from the one projection,
    whose gradients add up over the blocks, and the context back-propagates that sum through
    the projection once as it ends (a shared projection's graph can be walked only once). With
    grad and no such promise, and where this torch has no such function, nn.MHA runs as is."""
    real = getattr(F, "_in_projection_packed", None)
    if real is None or (torch.is_grad_enabled() and not backward):
        yield
        return
    shared = _SharedKeys(real)
    F._in_projection_packed = shared
    try:
        yield
    finally:
        F._in_projection_packed = real
    shared.backward()  # only when the blocks ended without an exception


class _SharedKeys:
    """nn.MHA's packed in-projection, the key and value projected at their first call only."""

    def __init__(self, real):
        self.real = real
        self.projected: dict = {}  # (key, value) by storage and layout -> what the blocks get
        self.pending: list = []  # (a projection with its graph, the leaf the blocks got)

    def __call__(self, q, k, v, w, b=None):
        if q is k:  # self-attention: nothing is shared between blocks
            return self.real(q, k, v, w, b)
        # nn.MHA hands each block fresh views (batch_first transposes): known by their storage
        key = tuple((t.data_ptr(), tuple(t.shape), t.stride()) for t in (k, v))
        if key not in self.projected:  # the first block: nn.MHA's own projection of all three
            q_proj, *kv = self.real(q, k, v, w, b)
            self.projected[key] = [self._leaf(t) for t in kv]
            return [q_proj, *self.projected[key]]
        return [F.linear(q, *_query_part(w, b, q.size(-1))), *self.projected[key]]

    def _leaf(self, t: torch.Tensor) -> torch.Tensor:
        """What the blocks share: without grad the projection itself; with grad a leaf cut from
        it, so that each block's backward stops there and adds its part to the leaf's grad."""
        if not t.requires_grad:
            return t
        leaf = t.detach().requires_grad_(True)
        self.pending.append((t, leaf))
        return leaf

    def backward(self) -> None:
        """The blocks' summed key and value gradients through the one projection, into the
        weights, biases, key and value (where nn.MHA's backward of each block put them)."""
        done = [(t, leaf.grad) for t, leaf in self.pending if leaf.grad is not None]
        self.pending.clear()
        if done:
            torch.autograd.backward([t for t, _ in done], [g for _, g in done])


def _query_part(w, b, E: int):
    """The query rows of nn.MHA's packed in-projection (weight, bias), as ``real`` splits it."""
    return w[:E], (None if b is None else b[:E])
