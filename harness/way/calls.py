"""Call a module on a point's inputs (``Inputs``) and collect every tensor the check compares,
by name (``collect``), and as the check compares them (``called``).

The call a module gets (``for_module``): at a decode point its KV cache, filled with the prefix
outside any timing, the next step on the same cache (``following``) and the rewind before each
timed call (``rewinder``); what a model feature has that the module does not compute itself, in
its float ``attn_mask`` as nn.MultiheadAttention takes it (``added``, ``handed``). The check and
the timing (harness/way/recheck.py, ``timed_call``) call a module alike.

Names are the same for every module, so a variant is compared with nn.MultiheadAttention like
for like: ``out``, ``attn_weights`` (when asked for) and, in mode=fwd_bwd, ``grad_query``
(``grad_key``, ``grad_value`` for cross-attention) and ``grad_<nn.MHA parameter name>``.

Gradients of a variant's own parameters are given in nn.MHA's names (harness/way/compared.py,
``map_grads``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from dataclasses import dataclass

import torch
import torch.nn as nn

from harness import features
from harness.config import CACHE_STEPS, Point
from harness.errors import AfterCheck
from harness.way.compared import Rows, comparable, map_grads
from harness.way.projection import keys_projected_once


@dataclass
class Inputs:
    query: torch.Tensor  # (B, L, E)
    key: torch.Tensor  # (B, S, E); the very same tensor as query for self-attention
    value: torch.Tensor  # (B, S, E); likewise
    kwargs: dict  # masks and flags for forward()
    grad_out: torch.Tensor  # (B, L, E): the fixed upstream gradient for mode=fwd_bwd
    # (B, P, E): decode (kv_cache_len=P): the tokens before the L new ones (``for_module``)
    prefix: torch.Tensor | None = None
    kv_cache: str = "static"  # how a module with a KV cache holds it (config.KV_CACHES)
    # decode: the next step's inputs (its L new tokens after these; ``following``), checked
    # after this step's so that what a step writes into the cache is read back
    then: "Inputs | None" = None
    # the point they were made for: its model features (harness/features/) hand a module what it
    # has no argument for (``added``) and make its KV cache (``for_module``); None: no feature
    point: Point | None = None
    hand: bool = True  # False: already handed (or, in query blocks, handed block by block)
    # what a decode point's KV cache is made with for a feature (a page table), on the CPU
    cache_kwargs: dict = dataclasses.field(default_factory=dict)

    def to(self, device: str, dtype: torch.dtype, requires_grad: bool = False) -> "Inputs":
        """A copy on device/dtype that keeps query-is-key-is-value identity (nn.MHA's fast path
        needs it); with ``requires_grad`` the tensors are fresh leaves that collect gradients."""

        def leaf(t: torch.Tensor) -> torch.Tensor:
            return t.detach().to(device, dtype).requires_grad_(requires_grad)

        query = leaf(self.query)
        key = query if self.key is self.query else leaf(self.key)
        value = key if self.value is self.key else leaf(self.value)
        kwargs = {
            k: (
                v.to(device, dtype if v.is_floating_point() else v.dtype)
                if isinstance(v, torch.Tensor)
                else v
            )
            for k, v in self.kwargs.items()
        }
        prefix = None if self.prefix is None else self.prefix.to(device, dtype)
        grad_out = self.grad_out.to(device, dtype)
        then = None if self.then is None else self.then.to(device, dtype, requires_grad)
        return dataclasses.replace(
            self, query=query, key=key, value=value, kwargs=kwargs, grad_out=grad_out,
            prefix=prefix, then=then,
        )  # fmt: skip

    def given(self) -> dict[str, torch.Tensor]:
        """Every tensor handed to forward() (inputs and masks) by name, as copies: what a
        drop-in must leave as it found it (``changed``)."""
        tensors = {
            **self.named(),
            **{k: v for k, v in self.kwargs.items() if isinstance(v, torch.Tensor)},
        }
        return {k: v.detach().clone() for k, v in tensors.items()}

    def changed(self, given: dict[str, torch.Tensor]) -> list[str]:
        """Names of the tensors whose values differ from ``given`` (modified in place)."""
        now = {
            **self.named(),
            **{k: v for k, v in self.kwargs.items() if isinstance(v, torch.Tensor)},
        }
        return [k for k, v in given.items() if not torch.equal(now[k].detach(), v)]

    def named(self) -> dict[str, torch.Tensor]:
        """The input tensors by name, each once (self-attention has a single input, ``query``)."""
        out = {"query": self.query}
        if self.key is not self.query:
            out["key"] = self.key
        if self.value is not self.key and self.value is not self.query:
            out["value"] = self.value
        return out


def additive(mask: torch.Tensor | None, dtype=torch.float64) -> torch.Tensor | None:
    """nn.MHA's mask as an additive float: bool True (may not attend) -> -inf (the one place:
    the oracle's inputs, nn.MHA's math in steps, what nn.MHA is handed)."""
    if mask is None or mask.dtype != torch.bool:
        return None if mask is None else mask.to(dtype)
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask, -math.inf)


def cache_style(model, style: str) -> str:
    """How a module holds a decode step's keys and values: ``style`` (config.KV_CACHES) when
    it has a KV cache, else ``none`` (it recomputes them from the whole sequence)."""
    return style if hasattr(model, "new_cache") and hasattr(model, "fill_cache") else "none"


def active(inputs) -> tuple:
    """The model features the inputs' point has on (none for inputs made without a point)."""
    return () if inputs.point is None else features.active(inputs.point)


def handed(
    kwargs: dict, added: torch.Tensor, B: int, H: int, L: int, S: int, dtype, device
) -> dict:
    """nn.MHA's call ``kwargs`` with ``added`` (broadcastable to (H, L, S)) in its ``attn_mask``:
    (B*H, L, S) float, the given mask (bool: -inf where it may not attend; (L, S) or
    (B*H, L, S)) plus ``added``; ``key_padding_mask`` additive too (nn.MHA wants both of one
    type); no ``is_causal`` hint (it would let nn.MHA drop the mask for its own causal one).
    Differentiable in ``added`` (a sink's gradient flows back through it)."""
    out = {k: v for k, v in kwargs.items() if k != "is_causal"}
    mask = added.to(device, dtype).expand(B, H, L, S)  # (B, H, L, S)
    given = additive(kwargs.get("attn_mask"), dtype)
    if given is not None:
        mask = mask + (given.view(B, H, L, S) if given.dim() == 3 else given)
    out["attn_mask"] = mask.reshape(B * H, L, S)
    if kwargs.get("key_padding_mask") is not None:
        out["key_padding_mask"] = additive(kwargs["key_padding_mask"], dtype)
    return out


def added(inputs, model, rows=None) -> torch.Tensor | None:
    """What ``model`` is handed in its float mask, broadcastable to (H, L, S): each feature's term
    for a module that does not compute it itself (ALiBi's bias; a sink's -s_h); None if
    nothing. ``rows``: the queries' rows only (the oracle in query blocks)."""
    if not inputs.hand:
        return None
    L = inputs.query.size(1)
    S = inputs.key.size(1) + (0 if inputs.prefix is None else inputs.prefix.size(1))
    total = None
    for feature in active(inputs):
        # (H, L, S), (H, 1, 1), ...: made on the query's device, in its dtype
        term = feature.term(inputs.point, model, L, S, rows, like=inputs.query)
        if term is not None:
            total = term if total is None else total.to(term) + term
    return total


def for_module(inputs, model):
    """The call ``model`` gets. Decode: a module with a KV cache (``new_cache`` and
    ``fill_cache``, variants/_core.py) gets the new tokens and a cache filled with the
    prefix's keys and values, outside any timing; any other (nn.MultiheadAttention) gets the
    new tokens as queries against the whole sequence, recomputing the prefix's keys and
    values in every call: the same output (``cache_style`` says which ran). What a model feature
    has the module computes itself where its class took the feature's argument; otherwise it is
    handed to it as nn.MHA takes it, in its float attn_mask (``added``)."""
    term = added(inputs, model)  # broadcastable to (H, L, S), or None
    if term is not None:
        whole = for_module(dataclasses.replace(inputs, hand=False), model)
        B, L = inputs.query.shape[:2]
        S = inputs.key.size(1) + (0 if inputs.prefix is None else inputs.prefix.size(1))
        kwargs = handed(whole.kwargs, term, B, inputs.point.num_heads, L, S, whole.query.dtype,
                        whole.query.device)  # fmt: skip
        return dataclasses.replace(whole, kwargs=kwargs)
    if inputs.prefix is None:
        return inputs
    if cache_style(model, inputs.kv_cache) != "none":
        B, P, _ = inputs.prefix.shape
        L, device, dtype = inputs.query.size(1), inputs.query.device, inputs.query.dtype
        # Room for more than this step: the checked steps and one more (``CACHE_STEPS``), so
        # that a cache which returns its whole buffer, not the P + L it holds, shows.
        capacity = P + CACHE_STEPS * L
        extra = {  # what a feature's cache is made with (a page table)
            k: v.to(device) if isinstance(v, torch.Tensor) else v
            for k, v in inputs.cache_kwargs.items()
        }
        cache = model.new_cache(inputs.kv_cache, B, capacity, device, dtype, **extra)
        model.fill_cache(cache, inputs.prefix)
        return _made(inputs, kwargs={**inputs.kwargs, "kv_cache": cache})
    whole = torch.cat([inputs.prefix, inputs.query], dim=1)  # (B, P + L, E)
    return _made(inputs, key=whole, value=whole)


def following(step, cached):
    """The next decode step's call for the module that ran ``step`` as ``cached`` (its
    ``for_module``): a module with a KV cache gets the next new tokens and the same cache, which
    holds this step's keys and values once committed (``advance``: the harness's caches commit
    there; a cache without it commits in ``update``); any other gets them against the whole
    sequence so far."""
    nxt = step.then
    cache = cached.kwargs.get("kv_cache")
    if cache is None:
        return nxt
    if hasattr(cache, "advance"):
        cache.advance()
    # handed nothing more: a term for its keys would need the cache's length (its first step's
    # mask was made for P + L keys)
    return _made(nxt, kwargs={**nxt.kwargs, "kv_cache": cache})


def _made(inputs, **changes):
    """``inputs`` as made for the module (``for_module``): nothing left to prefill, to follow or
    to hand."""
    return dataclasses.replace(inputs, prefix=None, then=None, hand=False, **changes)


def rewinder(model, kwargs: dict):
    """What returns a module and its KV cache to the prefix before each timed call, outside the
    timing (docs/adding.md, "The KV cache contract"): ``rewind()`` of the cache and of the module,
    for those that commit what a call appends; None when neither has one."""
    found = [
        obj.rewind
        for obj in (kwargs.get("kv_cache"), model)
        if obj is not None and callable(getattr(obj, "rewind", None))
    ]
    if not found:
        return None

    def rewind():
        for fn in found:
            fn()

    return rewind


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


def key_weights(model, weights: torch.Tensor | None) -> torch.Tensor | None:
    """Attention weights over the point's keys: nn.MHA with ``add_zero_attn`` (how it expresses a
    sink, harness/features/) returns one more column, its zero key's (the sink's share)."""
    if weights is None or not getattr(model, "add_zero_attn", False):
        return weights
    return weights[..., :-1]


# Names of the second decode step's tensors: ``step2_out``, ``step2_attn_weights``.
STEP2 = "step2_"
# The first call's output once more (``collect(repeat=True)``): not compared with nn.MHA but with
# the first call's ``out`` (harness/way/check.py).
REPEATED = "repeated_out"
# Where the repeated call is, in an error it raises.
REPEATED_CALL = "the checked call repeated (check_only)"


def collect(
    model: nn.Module, fn, inputs: Inputs, mode: str, reference_state: dict, repeat: bool = False
) -> dict[str, torch.Tensor]:
    """Run ``fn`` (``model`` itself or torch.compile over it) once; return the named tensors.

    ``inputs`` must require grad in mode=fwd_bwd (``Inputs.to(..., requires_grad=True)``).
    With ``repeat`` the call is made once more, as a timed call is (``repeated``): its output is
    ``REPEATED``. Decode: then the next step (``inputs.then``) on the same cache, its tensors named
    ``step2_*``, so that what the first step wrote is read back. The second step runs the module
    eagerly: a compiled one would recompile for the longer cache, and the rounds would time that
    graph instead of the checked one.
    """
    cached = for_module(inputs, model)  # decode: its cache, or the whole sequence
    tensors = _collect(model, fn, cached, mode, reference_state)
    if repeat:
        tensors[REPEATED] = repeated(model, fn, cached, mode)
    if inputs.then is not None:
        nxt = for_module(following(inputs, cached), model)
        second = _collect(model, model, nxt, mode, reference_state)
        tensors.update({STEP2 + k: v for k, v in second.items()})
    return tensors


def repeated(model: nn.Module, fn, inputs: Inputs, mode: str) -> torch.Tensor:
    """The output of ``fn`` called once more on ``inputs`` (made for the module: its cache as the
    call left it), after the rewind where there is one (``rewinder``): what every timed call after
    the first sees. An exception is an ``AfterCheck`` naming this call."""
    rewind = rewinder(model, inputs.kwargs)
    try:
        if rewind is not None:
            rewind()
        with torch.set_grad_enabled(mode == "fwd_bwd"):
            out, _ = fn(inputs.query, inputs.key, inputs.value, **inputs.kwargs)
    except Exception as e:
        raise AfterCheck(REPEATED_CALL, e) from e
    return out.detach()


def _collect(
    model: nn.Module, fn, inputs: Inputs, mode: str, reference_state: dict
) -> dict[str, torch.Tensor]:
    """``collect`` of one call, on inputs already made for the module (``for_module``)."""
    with torch.set_grad_enabled(mode == "fwd_bwd"):
        out, weights = fn(inputs.query, inputs.key, inputs.value, **inputs.kwargs)
    tensors = {"out": out.detach()}
    if inputs.kwargs.get("need_weights"):
        weights = key_weights(model, weights)
        tensors["attn_weights"] = weights.detach() if weights is not None else torch.empty(0)
    if mode == "fwd_bwd":
        model.zero_grad(set_to_none=True)
        out.backward(inputs.grad_out)
        for name, t in inputs.named().items():
            tensors[f"grad_{name}"] = t.grad.detach() if t.grad is not None else torch.zeros_like(t)
        tensors.update(map_grads(model, reference_state))
    return tensors


def run(point: Point, model, fn, inputs64: Inputs, state: dict, repeat=False, pinned=True):
    """``collect`` of ``fn`` on ``inputs64`` in the point's dtype on its device, fresh leaves with
    grad in fwd_bwd, under the point's SDPA pin (``pinned``); with the names of the inputs the
    call changed in place (a drop-in must leave them as it found them)."""
    inputs = inputs64.to(point.device, point.torch_dtype, point.mode == "fwd_bwd")
    given = inputs.given()
    with sdpa_context(point.sdpa_backend if pinned else "auto"):
        tensors = collect(model, fn, inputs, point.mode, state, repeat=repeat)
    return tensors, inputs.changed(given)


def masked(point: Point, rows: Rows | None, inputs: Inputs) -> Inputs:
    """``inputs`` as the check's calls on the full inputs get them: where the point samples
    ``rows`` in mode=fwd_bwd, a grad_out that is zero outside them, everything else the very same
    tensors (query-is-key identity kept); else ``inputs`` itself."""
    if rows is None or point.mode != "fwd_bwd":
        return inputs
    keep = torch.zeros(inputs.grad_out.size(1), dtype=torch.bool)
    keep[list(rows.index)] = True
    keep = keep.to(inputs.grad_out.device).view(1, -1, 1)
    grad_out = torch.where(keep, inputs.grad_out, torch.zeros_like(inputs.grad_out))
    return dataclasses.replace(inputs, grad_out=grad_out)


def in_float64(point: Point, rows: Rows | None, model, inputs64: Inputs, mode: str, state):
    """``collect`` of a module of nn.MHA's math (the oracle's, or a known mistake's: harness/way/
    steps.py) in float64 on the CPU, in ``mode``, as the check compares it (``comparable``)."""
    inputs = inputs64.to("cpu", torch.float64, mode == "fwd_bwd")
    return comparable(point, rows, collect(model, model, inputs, mode, state))


@dataclass(frozen=True)
class Called:
    """A module's call as a check sees it (``called``)."""

    tensors: dict  # by name, as the check compares them (``comparable``)
    out: torch.Tensor  # (B, L, E): the whole output, every query row (the re-check's)
    again: torch.Tensor | None  # the call repeated (``repeat``): its output, else None
    changed: list  # the names of the inputs the call modified in place (a drop-in must not)
    seconds: float  # the call's wall time, its first compile included (the row's compile_s)


def called(
    point: Point, rows: Rows | None, model, fn, inputs64: Inputs, state: dict, repeat=False,
    pinned=True,
) -> Called:  # fmt: skip
    """``collect`` of ``fn`` (``model`` or its compiled call) on ``inputs64`` in the point's dtype
    on its device, fresh leaves with grad in fwd_bwd (where the check samples query rows, after a
    backward of a grad_out zero outside them: ``masked``), under the point's SDPA pin
    (``pinned``; nn.MHA's yardstick runs unpinned); with ``repeat`` the call once more
    (``collect``)."""
    t0 = time.perf_counter()
    inputs = masked(point, rows, inputs64)
    got, changed = run(point, model, fn, inputs, state, repeat, pinned)
    seconds = time.perf_counter() - t0
    again = got.pop(REPEATED, None)
    return Called(comparable(point, rows, got), got["out"], again, changed, seconds)


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

    ``sample`` (sorted query row indices, harness/way/compared.py): those rows only, in blocks of
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
            if getattr(model, "positioned", False):  # the block's rows at their positions
                rows_at = block.cpu() if torch.is_tensor(block) else block
                given["positions"] = torch.arange(S - L, S)[rows_at]
            term = added(step, model, block)  # this block's rows of what it is handed
            if term is not None:  # (B*H, rows, S): never the whole (B*H, L, S) at once
                given = handed(given, term, B, step.point.num_heads, query.size(1), S,
                               query.dtype, query.device)  # fmt: skip
            out, w = model(query, inputs.key, inputs.value, **given)
            if mode == "fwd_bwd":
                out.backward(inputs.grad_out[:, block])  # gradients add up over the blocks
            outs.append(out.detach())
            if w is not None:
                weights.append(key_weights(model, w).detach())
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
