"""Instantiate a variant from its class (harness/way/capabilities.py finds it), give it the
reference's weights, optionally compile it; what the record says of the built module (its
distributions, how it holds a KV cache)."""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import inspect
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from harness import features
from harness.config import InvalidPoint, Point
from harness.way.calls import cache_style
from harness.way.compiling import maybe_compile


def takes(fn, *names: str) -> bool:
    """Whether ``fn(...)`` (a class, a method) takes the keywords ``names``: it names them, or
    takes ``**kwargs`` (a wrapper written ``__init__(self, *args, **kwargs)`` hands them on to
    the class it wraps)."""
    parameters = inspect.signature(fn).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return True
    return set(names) <= {p.name for p in parameters}


# The attribute a built module carries: what ``rounded_below`` found when it was loaded.
ROUNDED = "_mha_bench_rounded"


def rounded_below(model: nn.Module, dtype: torch.dtype) -> list[tuple[str, str]]:
    """(name, dtype) of the module's floating parameters and buffers that are less precise than
    ``dtype`` as it was built: nn.MHA's weights loaded into them are rounded to their dtype before
    the cast to the point's dtype (a library block that creates its parameters in bfloat16),
    which no tolerance at ``dtype`` allows for."""
    eps = torch.finfo(dtype).eps
    return [
        (name, str(t.dtype).removeprefix("torch."))
        for name, t in [*model.named_parameters(), *model.named_buffers()]
        if t.is_floating_point() and torch.finfo(t.dtype).eps > eps
    ]


def rounded_note(model: nn.Module, dtype: torch.dtype) -> str:
    """A failed check's note where the loaded weights were rounded ("" where none was)."""
    found = getattr(model, ROUNDED, [])
    if not found:
        return ""
    (name, built_in), more = found[0], len(found) - 1
    which = f"{name} and {more} more" if more else name
    return (
        f" Likely why: your module's {which} were {built_in} when "
        f"nn.MHA's weights were loaded: rounded to {built_in}, below the point's "
        f"{str(dtype).removeprefix('torch.')}; create its parameters in float32 (the harness "
        "casts the module to the point's dtype after loading)."
    )


# What a module may need to build itself, offered to a ``**kwargs`` wrapper too: where the class
# it hands them on to does not take one (TypeError naming it), it is built again without it.
OFFERED = ("window", "kv_cache_len")


def build_variant(point: Point, reference: nn.Module, cls: type) -> nn.Module:
    """The point's variant, of class ``cls`` (harness/way/capabilities.py found it), on its device
    and dtype, holding ``reference``'s weights, in eval mode."""
    spec = point.variant
    sizes = dict(embed_dim=point.embed_dim, num_heads=point.num_heads, bias=point.bias)
    if point.num_kv_heads != point.num_heads:  # grouped-query: only modules that take it
        if not takes(cls, "num_kv_heads"):
            raise NotImplementedError(
                f"variant={spec.name}: its class takes no num_kv_heads (grouped-query attention; "
                "docs/adding.md says how to add it)"
            )
        sizes["num_kv_heads"] = point.num_kv_heads
    # What a module may need to build itself as a library's config does (a window size, the
    # cache length), passed to classes whose constructor takes them: by name, or as a
    # ``__init__(self, *args, **kwargs)`` wrapper takes every key (``takes``), as it takes
    # num_kv_heads and a feature's argument (issue 73: a wrapper ran without its window).
    for name in OFFERED:
        if takes(cls, name) and getattr(point, name) is not None and name not in spec.options:
            sizes[name] = getattr(point, name)
    # A model feature's argument, to a class that takes it: it computes the feature itself. Any
    # other is handed it as nn.MHA is, in its attn_mask (harness/way/calls.py, for_module), or
    # cannot run it (a required feature: unsupported).
    for feature in features.active(point):
        argument = feature.argument(point)
        if takes(cls, *argument):
            sizes.update(argument)
        elif feature.required:
            raise NotImplementedError(
                f"variant={spec.name}: its class takes no {', '.join(argument)} ({feature.needs})"
            )
    hints = {n for n in OFFERED if n in sizes and n not in inspect.signature(cls).parameters}
    while True:
        try:
            model = cls(**sizes, **spec.options)
            break
        except (TypeError, ValueError) as e:  # the contract: bad options raise ValueError
            # a hint a wrapper handed on to a class that does not take it: offered, not needed
            refused = next((n for n in hints if f"'{n}'" in str(e) and n in sizes), None)
            if not isinstance(e, TypeError) or refused is None:
                raise InvalidPoint(f"variant={spec.name!r}: {e}") from e
            del sizes[refused]
    handed = frozenset(n for f in features.active(point) for n in f.argument(point) if n in sizes)
    object.__setattr__(model, features.HANDED, handed)  # a plain attribute, never a submodule
    object.__setattr__(model, ROUNDED, rounded_below(model, point.torch_dtype))
    model.load_state_dict(reference.state_dict())
    return model.to(device=point.device, dtype=point.torch_dtype).eval()


@functools.lru_cache(maxsize=None)
def _distributions() -> dict:
    # top-level package -> distributions (slow: once)
    return importlib.metadata.packages_distributions()


@functools.lru_cache(maxsize=None)
def distribution_of(module: str) -> str:
    """ "timm 1.0.31" for a module of an installed distribution, "" otherwise."""
    names = _distributions().get(module.split(".")[0], [])
    if not names:
        return ""
    try:
        return f"{names[0]} {importlib.metadata.version(names[0])}"
    except importlib.metadata.PackageNotFoundError:
        return ""


def distributions(model: nn.Module, own: str) -> str:
    """The distributions the built module is made of, its class's own first: an adapter in a
    user's directory that wraps transformers' BertSelfAttention says "transformers 5.23.0".
    torch itself is left out (torch_version says it)."""
    found = [own] if own else []
    for module in model.modules():
        name = type(module).__module__
        if not name.startswith("torch.") and name != "torch":
            dist = distribution_of(name)
            if dist and dist not in found:
                found.append(dist)
    return "; ".join(found)


@dataclass(frozen=True)
class Built:
    """A point's variant, built: the module, the callable to check and time (the module, or
    torch.compile over it), and what its record says of it."""

    model: nn.Module
    fn: Callable
    distribution: str  # the distributions it is made of (``distributions``)
    kv_cache: str  # decode: how it holds the cache (``cache_style``); "" at other points


def built(point: Point, reference: nn.Module, cls: type, distribution: str = "") -> Built:
    """``build_variant`` and ``maybe_compile`` of the point, and what the record says of the
    module (``distribution``: its class's own, ``provenance``'s)."""
    model = build_variant(point, reference, cls)
    made_of = distributions(model, distribution)
    style = "" if point.kv_cache_len is None else cache_style(model, point.kv_cache)
    for feature in features.active(point):  # what its cache must take for a feature
        if style not in ("", "none") and not takes(model.new_cache, *feature.cache_arguments):
            raise NotImplementedError(
                f"variant={point.variant.name}: kv_cache={point.kv_cache}, but its new_cache "
                f"takes no {' and '.join(f'{n}=' for n in feature.cache_arguments)} "
                '(docs/adding.md, "The KV cache contract")'
            )
    return Built(model, maybe_compile(model, point.compile), made_of, style)
