"""The yardsticks of one shape: the float64 oracle, nn.MultiheadAttention in the point's dtype
(what fixes the tolerance) and the activation scale, computed once for every way at the shape
(docs/methodology.md, "How a point is checked").

One ``Yardsticks`` object per shape. Its key is the point less its way and how it is measured
(``Point.shape_key``: the keys' roles, config.ROLES) with the dtype left out, since the oracle is
float64 whatever the point's dtype, and the query rows the check compares (harness/way/compared.py);
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

from harness.way.checks import At
from harness.way.calls import Inputs, called, collect_in_blocks
from harness.way.compared import Rows, grouped, key_of
from harness.way.footprint import handed_elements
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
        the check compares (harness/way/compared.py); at activation scale with ``scale``."""
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
                self._references[key] = called(
                    point, self.sample, reference, reference, inputs64, state, pinned=False
                ).tensors
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
