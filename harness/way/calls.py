"""Call a module on a point's inputs and collect every tensor the check compares, by name.

The call a module gets (``for_module``): at a decode point its KV cache, filled with the prefix
outside any timing, the next step on the same cache (``following``) and the rewind before each
timed call (``rewinder``); the check and the timing (``timed_call``: shared by the probe, the
rounds and the profiling pass, so that all three run exactly the same call) call a module alike.

Names are the same for every module, so a variant is compared with nn.MultiheadAttention like
for like: ``out``, ``attn_weights`` (when asked for) and, in mode=fwd_bwd, ``grad_query``
(``grad_key``, ``grad_value`` for cross-attention) and ``grad_<nn.MHA parameter name>``.

Gradients of a variant's own parameters are mapped back to nn.MHA's names through the
variant's load hooks: the hooks turn nn.MHA's state dict into the variant's layout with plain
tensor ops (chunk, reshape, permute), so running them on tensors that require grad and
back-propagating the variant's parameter gradients through them gives the gradient in nn.MHA's
layout. No per-variant mapping table; a parameter that receives no gradient counts as zero.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from harness.errors import AfterCheck
from harness.way.build import cache_style
from harness.way.inputs import Inputs

# A decode point's cache has room for this many steps of L tokens beyond its P: the two checked
# steps and one more, so that returning the whole buffer is never the right answer by chance.
CACHE_STEPS = 3


def for_module(inputs: Inputs, model) -> Inputs:
    """The call ``model`` gets. Decode: a module with a KV cache (``new_cache`` and
    ``fill_cache``, variants/_core.py) gets the new tokens and a cache filled with the
    prefix's keys and values, outside any timing; any other (nn.MultiheadAttention) gets the
    new tokens as queries against the whole sequence, recomputing the prefix's keys and
    values in every call: the same output (``cache_style`` says which ran)."""
    if inputs.prefix is None:
        return inputs
    if cache_style(model, inputs.kv_cache) != "none":
        B, P, _ = inputs.prefix.shape
        L, device, dtype = inputs.query.size(1), inputs.query.device, inputs.query.dtype
        # Room for more than this step: the checked steps and one more (``CACHE_STEPS``), so
        # that a cache which returns its whole buffer, not the P + L it holds, shows.
        cache = model.new_cache(inputs.kv_cache, B, P + CACHE_STEPS * L, device, dtype)
        model.fill_cache(cache, inputs.prefix)
        kwargs = {**inputs.kwargs, "kv_cache": cache}
        return Inputs(inputs.query, inputs.key, inputs.value, kwargs, inputs.grad_out)
    whole = torch.cat([inputs.prefix, inputs.query], dim=1)  # (B, P + L, E)
    return Inputs(inputs.query, whole, whole, inputs.kwargs, inputs.grad_out)


def following(step: Inputs, cached: Inputs) -> Inputs:
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
    kwargs = {**nxt.kwargs, "kv_cache": cache}
    return Inputs(nxt.query, nxt.key, nxt.value, kwargs, nxt.grad_out)


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


def reference_layout(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (nn.MHA's keys) turned into ``model``'s keys by its load pre-hooks, as
    ``load_state_dict`` would, but differentiably (nothing is copied into the model)."""
    converted = dict(state)
    for name, module in model.named_modules():  # parents first, as load_state_dict recurses
        prefix = f"{name}." if name else ""
        for hook in module._load_state_dict_pre_hooks.values():
            hook(converted, prefix, {}, True, [], [], [])
    return converted


def map_grads(
    model: nn.Module, reference_state: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The model's parameter gradients expressed in nn.MHA's parameter names and shapes."""
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in reference_state.items()}
    converted = reference_layout(model, leaves)
    outputs, grads = [], []
    for name, param in model.named_parameters():
        mapped = converted.get(name)
        if isinstance(mapped, torch.Tensor) and mapped.requires_grad:
            outputs.append(mapped)
            grads.append(param.grad if param.grad is not None else torch.zeros_like(param))
    names = list(leaves)
    found = (
        torch.autograd.grad(outputs, [leaves[n] for n in names], grads, allow_unused=True)
        if outputs
        else [None] * len(names)
    )
    return {
        f"grad_{n}": (g if g is not None else torch.zeros_like(leaves[n])).detach()
        for n, g in zip(names, found)
    }


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
        tensors["attn_weights"] = weights.detach() if weights is not None else torch.empty(0)
    if mode == "fwd_bwd":
        model.zero_grad(set_to_none=True)
        out.backward(inputs.grad_out)
        for name, t in inputs.named().items():
            tensors[f"grad_{name}"] = t.grad.detach() if t.grad is not None else torch.zeros_like(t)
        tensors.update(map_grads(model, reference_state))
    return tensors


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
    inputs = for_module(inputs, model)
    kwargs = {k: v for k, v in inputs.kwargs.items() if k != "is_causal"}
    attn_mask = kwargs.pop("attn_mask", None)
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
            if attn_mask is not None:  # (L, S) or (B*H, L, S): this block's rows
                rows_of = attn_mask[block] if attn_mask.dim() == 2 else attn_mask[:, block]
                kwargs["attn_mask"] = rows_of
            out, w = model(inputs.query[:, block], inputs.key, inputs.value, **kwargs)
            if mode == "fwd_bwd":
                out.backward(inputs.grad_out[:, block])  # gradients add up over the blocks
            outs.append(out.detach())
            if w is not None:
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


def timed_call(model, fn, inputs: Inputs, mode: str):
    """The zero-argument callable to time and what to run before each call, untimed: the rewind
    of a module or KV cache that commits what a call appends (``collect.rewinder``), and in
    fwd_bwd clearing the gradients. The call returns the forward's (out, weights): the re-check
    after the rounds compares it with the checked output (harness/way/recheck.py)."""
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
