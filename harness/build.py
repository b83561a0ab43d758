"""Instantiate a variant from its spec, give it the reference's weights, optionally compile it."""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import inspect
from pathlib import Path

import torch
import torch.nn as nn
from hydra.utils import get_class

from harness.config import InvalidPoint, Point, VariantSpec


def variant_class(spec: VariantSpec) -> type:
    """The variant's class, imported (not built)."""
    try:
        return get_class(spec.target)
    except Exception as e:  # ImportError wrapped by Hydra; say which target and why
        raise InvalidPoint(f"variant={spec.name!r}: cannot import _target_ {spec.target!r} ({e})") from e


def build_variant(point: Point, reference: nn.Module) -> nn.Module:
    """The point's variant on its device and dtype, holding ``reference``'s weights, in eval mode."""
    spec = point.variant
    cls = variant_class(spec)
    try:
        model = cls(embed_dim=point.embed_dim, num_heads=point.num_heads, bias=point.bias, **spec.options)
    except (TypeError, ValueError) as e:  # the contract: bad options raise ValueError naming them
        raise InvalidPoint(f"variant={spec.name!r}: {e}") from e
    model.load_state_dict(reference.state_dict())
    return model.to(device=point.device, dtype=point.torch_dtype).eval()


@functools.lru_cache(maxsize=None)
def provenance(target: str) -> dict:
    """Which code ran: the class's dotted path, a hash of the file it is defined in, and the
    installed distribution (name and version) its top-level package comes from, if any."""
    row = {"variant_target": target, "variant_source_hash": "", "variant_distribution": ""}
    try:
        cls = get_class(target)
    except Exception:
        return row  # build_variant says why
    try:
        path = inspect.getsourcefile(cls)
        if path:
            row["variant_source_hash"] = hashlib.sha1(Path(path).read_bytes()).hexdigest()[:12]
    except (TypeError, OSError):
        pass  # a builtin or generated class: no file to hash
    top = cls.__module__.split(".")[0]
    names = importlib.metadata.packages_distributions().get(top, [])
    if names:
        try:
            row["variant_distribution"] = f"{names[0]} {importlib.metadata.version(names[0])}"
        except importlib.metadata.PackageNotFoundError:
            pass
    return row


def maybe_compile(model: nn.Module, mode: str):
    """The callable to check and time: the module itself, or torch.compile over it."""
    if mode == "off":
        return model
    # mode=None is torch.compile's own default; the other names are passed through.
    return torch.compile(model, mode=None if mode == "default" else mode)
