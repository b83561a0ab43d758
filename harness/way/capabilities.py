"""What a variant says it can do, applied to a point before anything is built.

A variant declares, in its yaml and/or as class attributes of the same names:

    _supports_: {mask: [none, causal], cross: false, reason: "why, for the user"}
    _fixed_: {bias: false}

A point whose value of a ``_supports_`` key is not listed is ``unsupported``, with the
declaration (and its reason) as the row's error, and the module is never built: a sweep over
modules with different abilities costs nothing for the points they cannot do. A ``_fixed_`` key
replaces the asked value (a module with no biases runs every point with bias=false); the row
records what ran, and its ``fixed`` column what was asked instead. The yaml's entries win over the
class's, key by key (and a class's over its bases', key by key, each key with its own reason):
the yaml is the user's local say about a class they may not own.
"""

from __future__ import annotations

import dataclasses
import functools

from harness.config import Point, VariantSpec, choice_text
from harness.declarations import DECLARATION_KEYS, merged, parse_declaration, reason_of


@functools.lru_cache(maxsize=None)
def _class_declarations(cls: type) -> tuple[dict, dict]:
    """The class's declarations merged down its bases, key by key (``merged``): a subclass that
    declares one key keeps what its bases said of the others, with their reasons."""
    out = []
    for kind in DECLARATION_KEYS:
        declared: dict = {}
        for klass in reversed(cls.__mro__):
            raw = vars(klass).get(kind)
            if raw is not None:
                where = f"{klass.__module__}.{klass.__qualname__}.{kind}"
                declared = merged(declared, parse_declaration(raw, where, kind))
        out.append(declared)
    return tuple(out)


def _class(spec: VariantSpec) -> type:
    from harness.way.build import variant_class  # imports torch: only where a class is looked at

    return variant_class(spec)


def declarations(spec: VariantSpec) -> tuple[dict, dict]:
    """(supports, fixed) of the variant: its class's, overridden key by key by its yaml's."""
    supports, fixed = _class_declarations(_class(spec))
    return merged(supports, spec.supports), {**fixed, **spec.fixed}


def value_of(point: Point, key: str):
    if key == "device":
        return "cuda" if point.device.startswith("cuda") else point.device
    if key == "head_dim":
        return point.head_dim
    return getattr(point, key)


def kernel_declaration(point: Point) -> tuple[str, dict, str | None] | None:
    """(kernel name, what it supports, why it cannot run here) for a variant that runs one of
    variants/kernels/ (its class has ``kernel_supports``), else None. A kernel name that does not
    exist is left to the constructor, whose ValueError names it (status ``invalid``)."""
    hook = getattr(_class(point.variant), "kernel_supports", None)
    if hook is None:
        return None
    try:
        return hook(point.variant.options)
    except ValueError:
        return None


def _refusal(point: Point, supports: dict, who: str) -> str | None:
    for key, allowed in supports.items():
        if key != "reason" and value_of(point, key) not in allowed:
            derived = (  # the user may have said mask=none: say where causal came from
                " (a decode step, kv_cache_len, is causal: mask=none reads causal)"
                if key == "mask" and point.kv_cache_len is not None and point.mask == "causal"
                else ""
            )
            return (
                f"{key}={choice_text(value_of(point, key))}{derived}: {who} declares "
                f"{key}={'|'.join(choice_text(a) for a in allowed)}"
                + (f" ({reason_of(supports, key)})" if reason_of(supports, key) else "")
            )
    return None


def apply(point: Point) -> tuple[Point, str, str | None]:
    """The point the variant runs (its fixed values in place of the asked ones); the ``fixed``
    column ("bias=false (asked true)", "" when nothing changed); and why the point is unsupported,
    or None: by the variant's declaration, then its kernel's (variants/kernels/). Raises
    InvalidPoint when the class cannot be imported or declares nonsense."""
    supports, fixed = declarations(point.variant)
    changes = {k: v for k, v in fixed.items() if value_of(point, k) != v}
    note = "; ".join(
        f"{k}={choice_text(v)} (asked {choice_text(value_of(point, k))})"
        for k, v in changes.items()
    )
    point = dataclasses.replace(point, **changes)
    refused = _refusal(point, supports, f"variant={point.variant.name}")
    kernel = None if refused else kernel_declaration(point)
    if kernel is not None:
        name, kernel_supports, missing = kernel
        refused = missing or _refusal(point, kernel_supports, f"attention={name}")
    return point, note, refused
