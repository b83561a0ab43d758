"""Instantiate a variant from its spec, give it the reference's weights, optionally compile it."""

from __future__ import annotations

import torch
import torch.nn as nn
from hydra.utils import get_class

from harness.config import InvalidPoint, Point


def build_variant(point: Point, reference: nn.Module) -> nn.Module:
    """The point's variant on its device and dtype, holding ``reference``'s weights, in eval mode."""
    spec = point.variant
    try:
        cls = get_class(spec.target)
    except Exception as e:  # ImportError wrapped by Hydra; say which target and why
        raise InvalidPoint(f"variant={spec.name!r}: cannot import _target_ {spec.target!r} ({e})") from e
    try:
        model = cls(embed_dim=point.embed_dim, num_heads=point.num_heads, bias=point.bias, **spec.options)
    except (TypeError, ValueError) as e:  # the contract: bad options raise ValueError naming them
        raise InvalidPoint(f"variant={spec.name!r}: {e}") from e
    model.load_state_dict(reference.state_dict())
    return model.to(device=point.device, dtype=point.torch_dtype).eval()


def maybe_compile(model: nn.Module, mode: str):
    """The callable to check and time: the module itself, or torch.compile over it."""
    if mode == "off":
        return model
    # mode=None is torch.compile's own default; the other names are passed through.
    return torch.compile(model, mode=None if mode == "default" else mode)
