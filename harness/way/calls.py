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
import dataclasses
from dataclasses import dataclass

import torch
import torch.nn as nn

from harness import features
from harness.config import CACHE_STEPS, Point
from harness.errors import AfterCheck
from harness.way.handed import handed
from harness.way.rows import compared, masked


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


def cache_style(model, style: str) -> str:
    """How a module holds a decode step's keys and values: ``style`` (config.KV_CACHES) when
    it has a KV cache, else ``none`` (it recomputes them from the whole sequence)."""
    return style if hasattr(model, "new_cache") and hasattr(model, "fill_cache") else "none"


def active(inputs: Inputs) -> tuple:
    """The model features the inputs' point has on (none for inputs made without a point)."""
    return () if inputs.point is None else features.active(inputs.point)


def added(inputs: Inputs, model, rows=None) -> torch.Tensor | None:
    """What ``model`` is handed in its float mask, broadcastable to (H, L, S): each feature's term
    for a module that does not compute it itself (ALiBi's bias; a sink's -s_h); None if
    nothing. ``rows``: the queries' rows only (the oracle in query blocks)."""
    if not inputs.hand:
        return None
    L = inputs.query.size(1)
    S = inputs.key.size(1) + (0 if inputs.prefix is None else inputs.prefix.size(1))
    total = None
    for feature in active(inputs):
        term = feature.term(inputs.point, model, L, S, rows)  # (H, L, S), (H, 1, 1), ...
        if term is not None:
            total = term if total is None else total.to(term) + term
    return total


def for_module(inputs: Inputs, model) -> Inputs:
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
        extra = {}  # what a feature's cache is made with (a page table)
        for feature in active(inputs):
            extra.update(feature.cache_kwargs(inputs.point, device))
        cache = model.new_cache(inputs.kv_cache, B, capacity, device, dtype, **extra)
        model.fill_cache(cache, inputs.prefix)
        kwargs = {**inputs.kwargs, "kv_cache": cache}
        return Inputs(inputs.query, inputs.key, inputs.value, kwargs, inputs.grad_out,
                      point=inputs.point, hand=False)  # fmt: skip
    whole = torch.cat([inputs.prefix, inputs.query], dim=1)  # (B, P + L, E)
    return Inputs(inputs.query, whole, whole, inputs.kwargs, inputs.grad_out, point=inputs.point,
                  hand=False)  # fmt: skip


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
    # handed nothing more: a term for its keys would need the cache's length (its first step's
    # mask was made for P + L keys)
    return Inputs(nxt.query, nxt.key, nxt.value, kwargs, nxt.grad_out, point=nxt.point,
                  hand=False)  # fmt: skip


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
        for feature in active(inputs):  # a zero key's column dropped (a sink's)
            weights = feature.weights(model, weights)
        tensors["attn_weights"] = weights.detach() if weights is not None else torch.empty(0)
    if mode == "fwd_bwd":
        model.zero_grad(set_to_none=True)
        out.backward(inputs.grad_out)
        for name, t in inputs.named().items():
            tensors[f"grad_{name}"] = t.grad.detach() if t.grad is not None else torch.zeros_like(t)
        tensors.update(map_grads(model, reference_state))
    return tensors


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


def sum_groups(tensors: dict, E: int, H: int, G: int) -> dict:
    """Gradients of a grouped-query model in nn.MHA's layout (G query heads per K/V head).

    As nn.MHA, each K/V head is G copies (harness/way/inputs.py, ``tie_groups``), and each copy gets
    the gradient of its own query head; the grouped module has one parameter for them, whose
    gradient is their sum (mapped back onto the group's first head). Both read the same once the
    K/V rows of ``grad_in_proj_weight`` and ``grad_in_proj_bias`` hold, per group, the group's
    sum on every head: applied to the oracle, nn.MHA and the variant alike."""
    if G == 1:
        return tensors
    out = dict(tensors)
    D = E // H
    for name in ("grad_in_proj_weight", "grad_in_proj_bias"):
        t = tensors.get(name)
        if t is None or t.numel() == 0 or t.size(0) != 3 * E:
            continue
        t = t.clone()
        for part in (t[E : 2 * E], t[2 * E :]):  # K rows, V rows
            heads = part.view(H // G, G, D, *part.shape[1:])  # (Hkv, G, D, ...)
            heads.copy_(heads.sum(dim=1, keepdim=True).expand_as(heads).clone())
        out[name] = t
    return out


def grouped(point: Point, tensors: dict) -> dict:
    """The tensors the check compares: grouped-query gradients per group
    (``sum_groups``); a bias the point's layout leaves out (``bias``: qkv, out) is zero
    in nn.MHA and has no gradient to compare (the module may have no such parameter)."""
    absent = {"grad_in_proj_bias": not point.in_bias, "grad_out_proj.bias": not point.out_bias}
    kept = {k: v for k, v in tensors.items() if not absent.get(k)}
    return sum_groups(kept, point.embed_dim, point.num_heads, point.groups)


def comparable(point: Point, tensors: dict) -> dict:
    """A module's tensors (``collect``'s, as they came) as the check compares them with the
    oracle's: grouped (``grouped``), the sampled rows of the forward tensors (``compared``)."""
    return compared(point, grouped(point, tensors))


def called(point: Point, model, fn, inputs64: Inputs, state: dict) -> dict:
    """``collect`` of ``fn`` (``model`` or its compiled call) on ``inputs64`` in the point's dtype
    on its device, fresh leaves with grad in fwd_bwd: the tensors a check compares (where the
    check samples query rows, after a backward of a grad_out zero outside them: rows.py), as it
    compares them (``comparable``)."""
    inputs = masked(point, inputs64)
    inputs = inputs.to(point.device, point.torch_dtype, point.mode == "fwd_bwd")
    return comparable(point, collect(model, fn, inputs, point.mode, state))
