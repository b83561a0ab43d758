"""The yardsticks of one shape: the float64 oracle, nn.MultiheadAttention in the point's dtype
(what fixes the tolerance) and the activation scale, computed once for every way at the shape
(docs/methodology.md, "How a point is checked").

One ``Yardsticks`` object per shape. Its key is the point less its way and how it is measured
(``Point.shape_key``: the keys' roles, config.ROLES) with the dtype left out, since the oracle is
float64 whatever the point's dtype, and the query rows the check compares (harness/way/rows.py);
what it holds depends on that key alone, never on a way: the
activation scale is kept as its factor and channels (``Scale``), and each point scales its own
inputs (a decode point's KV-cache style is its way's). Nothing is module-global: a ``Shelf``
holds the current shape's object for whoever runs points one after another (the worker's loop,
harness/sweep/serve.py), and drops it when the shape changes. A point run alone gets a shelf of
its own, so it computes exactly what it would in a sweep, in any order (tested as a property:
tests/test_order.py).

The computations run with torch as the worker found it (``Fingerprint.as_found``): a variant that
patches nn.MultiheadAttention or F.scaled_dot_product_attention on import cannot change what it is
checked against.
"""

from __future__ import annotations

import dataclasses
import contextlib
import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from harness.way.checks import At
from harness.way.calls import STEP2, active, added, called, collect, for_module, grouped, Inputs
from harness.way.calls import map_grads
from harness.way.footprint import handed_elements
from harness.way.handed import handed
from harness.way.rows import key_of, Rows
from harness.way.scale import Scale, find_scale
from harness.config import Point
from harness.fingerprint import Fingerprint

# The oracle's query blocks: float64 scores of at most this many bytes where nn.MHA holds them.
ORACLE_BLOCK_BYTES = 256 * 2**20
# A CUDA point's oracle runs on its GPU, in float64, and comes back to the CPU: at the long
# step's L=8192, E=2048, B=2 even a sampled oracle projects every key and value (2.7e11 FLOP, x3
# with grad), seconds on a host's cores against milliseconds in a GPU's float64 (1/2 to 1/64 of
# its float32 rate, still tens of times a CPU's), and the activation scale's logits likewise
# (docs/measurements.md, "Checks at GPU sizes"). Out of memory there: the CPU, as before.
ORACLE_ON_GPU = True


def oracle_device(point: Point) -> str:
    """Where the float64 oracle runs: a CUDA point's GPU (``ORACLE_ON_GPU``), else the CPU."""
    return point.device if ORACLE_ON_GPU and point.device.startswith("cuda") else "cpu"


def on_oracle_device(point: Point, oracle_model):
    """The oracle's nn.MHA (float64, CPU) where the oracle runs: a copy on a CUDA point's GPU,
    made for one computation and dropped after it (nothing of the oracle stays on the GPU)."""
    device = oracle_device(point)
    return oracle_model if device == "cpu" else copy.deepcopy(oracle_model).to(device)


def where_it_fits(point: Point, oracle_model, compute):
    """``compute(model)`` with the oracle's nn.MHA where the oracle runs (``on_oracle_device``);
    the GPU full, on the CPU, as before."""
    if oracle_device(point) == "cpu":
        return compute(oracle_model)
    try:
        return compute(on_oracle_device(point, oracle_model))
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return compute(oracle_model)


def compute_oracle(point: Point, inputs64: Inputs, model, sample: Rows | None) -> dict:
    """The oracle computed where ``model`` is, brought back to the CPU."""
    grad = point.mode == "fwd_bwd"
    device = model.in_proj_weight.device
    # In query blocks whose float64 scores stay under ORACLE_BLOCK_BYTES (one block at small
    # shapes) where nn.MHA materialises them: without grad (its fast path) and for the weights,
    # and on a GPU (no fused kernel runs float64 there). On the CPU with grad and no weights it
    # runs SDPA's fused kernel, which holds no scores and is faster whole (docs/measurements.md).
    rows = max(1, ORACLE_BLOCK_BYTES // (point.batch * point.num_heads * point.kv_seq_len * 8))
    # ... unless it is handed a float (B*H, L, S) mask for a model feature: that mask is as
    # large as the scores, so it comes in blocks too (a block's rows each).
    if grad and not point.need_weights and device.type == "cpu" and not handed_elements(point):
        rows = point.seq_len
    oracle = collect_in_blocks(
        model,
        inputs64.to(device, torch.float64, grad),
        point.mode,
        model.state_dict(),
        rows,
        None if sample is None else sample.tensor(),
    )
    return {k: v.cpu() for k, v in oracle.items()}


def scaled(inputs: Inputs, chans: tuple[int, ...], factor: float) -> Inputs:
    """``inputs`` with ``chans`` of every token multiplied by ``factor`` (a decode point's prefix
    and next step too); identities (query is key is value) and masks kept."""
    index = torch.tensor(chans)

    def up(t):
        if t is None:
            return None
        t = t.detach().clone()
        t[..., index] *= factor
        return t

    query = up(inputs.query)
    key = query if inputs.key is inputs.query else up(inputs.key)
    value = key if inputs.value is inputs.key else up(inputs.value)
    then = None if inputs.then is None else scaled(inputs.then, chans, factor)
    return dataclasses.replace(
        inputs, query=query, key=key, value=value, prefix=up(inputs.prefix), then=then
    )


class Yardsticks:
    """One shape's yardsticks, computed on first use. Every method takes the point asking (any
    way at the shape, any dtype for the oracle) and returns the same thing for every way."""

    def __init__(self, key, fingerprint: Fingerprint | None = None):
        self.key = key
        self.sample: Rows | None = key[1]  # the query rows compared (None: every row)
        self.fingerprint = fingerprint
        self._oracles: dict = {}  # by scale (None: the point's own inputs)
        self._references: dict = {}  # by dtype and scale
        self._scales: dict = {}  # by target logit

    def _as_found(self):
        return self.fingerprint.as_found() if self.fingerprint else contextlib.nullcontext()

    def at(self, point: Point, oracle_model, inputs64: Inputs, state: dict, scale=None) -> At:
        """The yardsticks a way at this shape is compared with, in the point's dtype, on the
        point's own inputs or at activation scale (``scale``)."""
        oracle = self.oracle(point, inputs64, oracle_model, scale)
        return At(oracle, self.reference(point, oracle_model, inputs64, state, scale), self.sample)

    def oracle(self, point: Point, inputs64: Inputs, oracle_model, scale: Scale | None = None):
        """The float64 oracle's tensors (grouped), on the CPU: every query row, or the sample
        the check compares (harness/way/rows.py); at activation scale with ``scale``."""
        key, sample = scale, self.sample
        if key not in self._oracles:
            inputs64 = self.scaled(inputs64, scale)
            with self._as_found():
                oracle = where_it_fits(
                    point, oracle_model, lambda m: compute_oracle(point, inputs64, m, sample)
                )
            self._oracles[key] = grouped(point, oracle)
        return self._oracles[key]

    def reference(
        self, point: Point, oracle_model, inputs64: Inputs, state: dict, scale: Scale | None = None
    ):
        """nn.MHA in the point's dtype on the point's device (the oracle's module, cast): what
        fixes the tolerance."""
        key = (point.dtype, scale)
        if key not in self._references:
            inputs64 = self.scaled(inputs64, scale)
            with self._as_found():
                reference = copy.deepcopy(oracle_model).to(point.device, point.torch_dtype)
                self._references[key] = called(point, reference, reference, inputs64, state)
        return self._references[key]

    def scale(self, point: Point, oracle_model, inputs64: Inputs) -> Scale:
        """The activation scale of the shape (harness/way/scale.py): which channels, by what
        factor. ``scaled`` applies it to a point's own inputs."""
        key, sample = point.check_max_logit, self.sample
        if key not in self._scales:
            rows = None if sample is None else sample.tensor()
            with self._as_found():  # where the oracle runs: the keys' projection is the oracle's
                found = where_it_fits(
                    point,
                    oracle_model,
                    lambda m: find_scale(m, inputs64, point.check_max_logit, point.seed, rows),
                )
            self._scales[key] = found
        return self._scales[key]

    @staticmethod
    def scaled(inputs64: Inputs, scale: Scale | None) -> Inputs:
        """A point's own inputs at ``scale`` (None: as they are)."""
        return inputs64 if scale is None else scaled(inputs64, scale.channels, scale.factor)


class Shelf:
    """The current shape's ``Yardsticks`` for points run one after another: the same object for
    consecutive points of one shape (the sweeper runs the ways of a shape together:
    hydra_plugins/mha_bench/sweeper.py, shapes_together), a new one when the shape changes, so
    that at most one shape's tensors are held."""

    def __init__(self, fingerprint: Fingerprint | None = None):
        self.fingerprint = fingerprint
        self.current: Yardsticks | None = None

    def at(self, point: Point) -> Yardsticks:
        key = key_of(point)
        if self.current is None or self.current.key != key:
            self.current = None  # the last shape's tensors go before the next shape's come
            self.current = Yardsticks(key, self.fingerprint)
        return self.current


def collect_in_blocks(
    model: nn.Module,
    inputs: Inputs,
    mode: str,
    reference_state: dict,
    rows: int,
    sample: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """``collect`` for nn.MultiheadAttention (the oracle) in blocks of ``rows`` query rows, so
    that its B·H·L·S scores never exist at once (17 GB in float64 at B=2, H=16, L=8192).

    Query rows attend independently given the keys and values, so each block is nn.MHA itself
    on ``query[:, rows]`` against the whole key and value, with its rows of ``attn_mask`` (given
    explicitly: the ``is_causal`` hint would mean a causal mask aligned to the block). Outputs and
    weights are the blocks' rows put together; in fwd_bwd each block back-propagates its rows of
    ``grad_out``, and the input and parameter gradients add up over the blocks. The key and value
    are projected once for all blocks, with grad too (``keys_projected_once``). One block (L <=
    ``rows``) is ``collect`` itself.

    ``sample`` (sorted query row indices, harness/way/rows.py): those rows only, in blocks of
    ``rows``. ``out`` (B, n, E) and the weights (B, [H,] n, S) are theirs; each block
    back-propagates its rows of ``grad_out``, and the gradients are the whole inputs' and
    parameters' (the query's zero outside the sample). Not at a decode point (``then``).
    """
    L = inputs.query.size(1)
    if sample is None and rows >= L:
        return collect(model, model, inputs, mode, reference_state)
    if sample is not None and inputs.then is not None:
        raise ValueError("a decode point's oracle compares every row: no sample")
    step = inputs
    inputs = for_module(dataclasses.replace(inputs, hand=False), model)  # handed per block
    kwargs = {k: v for k, v in inputs.kwargs.items() if k != "is_causal"}
    attn_mask = kwargs.pop("attn_mask", None)
    B, S = inputs.query.size(0), inputs.key.size(1)
    outs, weights = [], []
    model.zero_grad(set_to_none=True)
    grad = mode == "fwd_bwd"
    with torch.set_grad_enabled(grad), keys_projected_once(backward=grad):
        if sample is None:
            blocks = [slice(start, min(start + rows, L)) for start in range(0, L, rows)]
        else:  # index tensors: each block's query rows, attn_mask rows and grad_out rows
            index = sample.to(inputs.query.device)
            blocks = [index[start : start + rows] for start in range(0, len(index), rows)]
        for block in blocks:
            given = dict(kwargs)
            if attn_mask is not None:  # (L, S) or (B*H, L, S): this block's rows
                rows_of = attn_mask[block] if attn_mask.dim() == 2 else attn_mask[:, block]
                given["attn_mask"] = rows_of
            query = inputs.query[:, block]
            term = added(step, model, block)  # this block's rows of what it is handed
            if term is not None:  # (B*H, rows, S): never the whole (B*H, L, S) at once
                given = handed(given, term, B, step.point.num_heads, query.size(1), S,
                               query.dtype, query.device)  # fmt: skip
            out, w = model(query, inputs.key, inputs.value, **given)
            if mode == "fwd_bwd":
                out.backward(inputs.grad_out[:, block])  # gradients add up over the blocks
            outs.append(out.detach())
            if w is not None:
                for feature in active(step):  # a zero key's column dropped (a sink's)
                    w = feature.weights(model, w)
                weights.append(w.detach())
    tensors = {"out": torch.cat(outs, dim=1)}  # (B, L, E); a sample's n rows: (B, n, E)
    if inputs.kwargs.get("need_weights"):
        tensors["attn_weights"] = torch.cat(weights, dim=-2)  # (B, [H,] L or n, S)
    if mode == "fwd_bwd":
        for name, t in inputs.named().items():
            tensors[f"grad_{name}"] = t.grad.detach() if t.grad is not None else torch.zeros_like(t)
        tensors.update(map_grads(model, reference_state))
    if step.then is not None:  # the next decode step (nn.MHA: against the whole sequence)
        second = collect_in_blocks(model, step.then, mode, reference_state, rows)
        tensors.update({STEP2 + k: v for k, v in second.items()})
    return tensors


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
