"""Instantiate a variant from its spec, give it the reference's weights, optionally compile it;
what the record says of the built module (its distributions, how it holds a KV cache)."""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.metadata
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch.nn as nn

from harness import features
from harness.config import InvalidPoint, Point, VariantSpec
from harness.way.calls import cache_style
from harness.way.compiling import maybe_compile


def locate(target: str):
    """The object at a dotted path (``pkg.mod.Class``, as a ``_target_`` names it). Hydra's
    ``get_class`` logged three lines on every failure and wrapped the cause in a multi-line
    message; here ``ImportError`` says in one line what is missing."""
    parts = target.split(".")
    for i in range(len(parts) - 1, 0, -1):
        name = ".".join(parts[:i])
        try:
            found = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name and (name == e.name or name.startswith(e.name + ".")):
                continue  # this path is not a module: a shorter one may be
            raise ImportError(f"{name} imports {e.name!r}, which is not installed") from e
        except Exception as e:  # noqa: BLE001 (the module's own failure, said)
            raise ImportError(f"importing {name} failed: {type(e).__name__}: {e}") from e
        for attr in parts[i:]:
            if not hasattr(found, attr):
                raise ImportError(f"{name} has no {'.'.join(parts[i:])!r}")
            found = getattr(found, attr)
        return found
    raise ImportError(f"no module named {parts[0]!r}")


def variant_class(spec: VariantSpec) -> type:
    """The variant's class, imported (not built)."""
    try:
        return locate(spec.target)
    except ImportError as e:
        said = " ".join(str(e).split())
        raise InvalidPoint(
            f"variant={spec.name!r}: cannot import _target_ {spec.target!r}: {said}"
        ) from e


def takes(cls: type, name: str) -> bool:
    """Whether ``cls(...)`` takes the keyword ``name``: it names it, or takes ``**kwargs`` (a
    wrapper written ``__init__(self, *args, **kwargs)`` hands it on to the class it wraps)."""
    parameters = inspect.signature(cls).parameters.values()
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def build_variant(point: Point, reference: nn.Module) -> nn.Module:
    """The point's variant on its device and dtype, holding ``reference``'s weights, in eval
    mode."""
    spec = point.variant
    cls = variant_class(spec)
    sizes = dict(embed_dim=point.embed_dim, num_heads=point.num_heads, bias=point.bias)
    if point.num_kv_heads != point.num_heads:  # grouped-query: only modules that take it
        if not takes(cls, "num_kv_heads"):
            raise NotImplementedError(
                f"variant={spec.name}: its class takes no num_kv_heads (grouped-query attention; "
                "docs/adding.md says how to add it)"
            )
        sizes["num_kv_heads"] = point.num_kv_heads
    # What a module may need to build itself as a library's config does (a window size, the
    # cache length), passed only to classes whose constructor names them.
    accepted = inspect.signature(cls).parameters
    for name in ("window", "kv_cache_len"):
        if name in accepted and getattr(point, name) is not None and name not in spec.options:
            sizes[name] = getattr(point, name)
    # A model feature's argument, to a class that takes it: it computes the feature itself. Any
    # other is handed it as nn.MHA is, in its attn_mask (harness/way/calls.py, for_module), or
    # cannot run it (a required feature: unsupported).
    for feature in features.active(point):
        argument = feature.argument(point)
        if all(takes(cls, name) for name in argument):
            sizes.update(argument)
        elif feature.required:
            raise NotImplementedError(feature.refusal(spec.name))
    try:
        model = cls(**sizes, **spec.options)
    except (TypeError, ValueError) as e:  # the contract: bad options raise ValueError naming them
        raise InvalidPoint(f"variant={spec.name!r}: {e}") from e
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


@functools.lru_cache(maxsize=None)
def provenance(target: str) -> dict:
    """Which code ran: the class's dotted path, a hash of the file it is defined in, and the
    installed distribution (name and version) its top-level package comes from, if any."""
    row = {"variant_target": target, "variant_source_hash": "", "variant_distribution": ""}
    try:
        cls = locate(target)
    except Exception:
        return row  # build_variant says why
    try:
        path = inspect.getsourcefile(cls)
        if path:
            row["variant_source_hash"] = hashlib.sha1(Path(path).read_bytes()).hexdigest()[:12]
    except (TypeError, OSError):
        pass  # a builtin or generated class: no file to hash
    row["variant_distribution"] = distribution_of(cls.__module__)
    return row


@dataclass(frozen=True)
class Built:
    """A point's variant, built: the module, the callable to check and time (the module, or
    torch.compile over it), and what its record says of it."""

    model: nn.Module
    fn: Callable
    distribution: str  # the distributions it is made of (``distributions``)
    kv_cache: str  # decode: how it holds the cache (``cache_style``); "" at other points


def built(point: Point, reference: nn.Module, distribution: str = "") -> Built:
    """``build_variant`` and ``maybe_compile`` of the point, and what the record says of the
    module (``distribution``: its class's own, ``provenance``'s)."""
    model = build_variant(point, reference)
    made_of = distributions(model, distribution)
    style = "" if point.kv_cache_len is None else cache_style(model, point.kv_cache)
    for feature in features.active(point):  # what the built module must have for it
        feature.built(point, model, point.variant.name)
    return Built(model, maybe_compile(model, point.compile), made_of, style)
