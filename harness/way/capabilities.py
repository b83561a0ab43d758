"""What a variant says it can do, applied to a point before anything is built.

A variant declares, in its yaml and/or as class attributes of the same names:

    _supports_: {mask: [none, causal], cross: false, reason: "why, for the user"}
    _fixed_: {bias: false}

A point whose value of a ``_supports_`` key is not listed is ``unsupported``, with the
declaration (and its reason) as the row's error, and the module is never built: a sweep over
modules with different abilities costs nothing for the points they cannot do. A ``_fixed_`` key
replaces the asked value (a module with no biases runs every point with bias=false); the row
records what ran, and its ``fixed`` column what was asked instead. The yaml's entries win over the
class's, key by key: the yaml is the user's local say about a class they may not own.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools

from harness.config import InvalidPoint, Point, VariantSpec, choice_text, choices_of, is_choice

# What a variant may declare about itself: in its yaml as `_supports_: {key: value or [values],
# reason: "..."}` and `_fixed_: {key: value}`, or as class attributes of the same names. Keys are
# config keys (plus head_dim); values are checked like the config's own: the keys with choices
# (``key(choices=...)`` in harness/config.py), the shape's flags, and the sizes.
DECLARATION_KEYS = ("_supports_", "_fixed_")
# The head merges every hand-written structure offers (``variant.merge``, variants/_core.py): the
# toggles preset sweeps them and effects compare them.
MERGES = ("view", "reshape")
CAPABILITY_CHOICES = {**choices_of(Point), "device": ("cpu", "cuda")}
CAPABILITY_BOOLS = tuple(
    f.name
    for f in dataclasses.fields(Point)
    if f.metadata.get("role") == "shape"
    and isinstance(f.default, bool)
    and f.name not in CAPABILITY_CHOICES
)
CAPABILITY_SIZES = (
    "batch",
    "seq_len",
    "kv_seq_len",
    "embed_dim",
    "num_heads",
    "head_dim",
    "num_kv_heads",
    "kv_cache_len",
    "window",
)
# A fixed value replaces the asked one; sizes, cross and device are left out because other keys'
# validity depends on them (kv_seq_len needs cross; embed_dim must divide by num_heads).
FIXABLE = (
    "mask",
    "mask_format",
    "mode",
    "dtype",
    "compile",
    "sdpa_backend",
    "bias",
    "need_weights",
    "average_attn_weights",
)


def _capability_value(where: str, key: str, value):
    """One declared value, checked like the config key it names (``compile: off`` reads False)."""
    if key == "compile" and (value is False or value is None):
        value = "off"
    if key in CAPABILITY_CHOICES:
        ok = is_choice(value, CAPABILITY_CHOICES[key])
        allowed = "|".join(choice_text(c) for c in CAPABILITY_CHOICES[key])
    elif key in CAPABILITY_BOOLS:
        ok, allowed = isinstance(value, bool), "true|false"
    else:
        ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
        allowed = "a positive integer"
    if not ok:
        raise InvalidPoint(f"{where}.{key}={value!r} is not one of {allowed}")
    return value


def parse_declaration(raw, where: str, kind: str) -> dict:
    """``_supports_`` -> {key: tuple of allowed values, "reason": str}; ``_fixed_`` -> {key: value}.
    ``where`` names the declaration in messages, e.g. "variant=mine: _supports_"."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise InvalidPoint(f"{where} must be a mapping of config keys, not {raw!r}")
    keys = (
        FIXABLE
        if kind == "_fixed_"
        else (*CAPABILITY_CHOICES, *CAPABILITY_BOOLS, *CAPABILITY_SIZES)
    )
    out: dict = {}
    for key, value in raw.items():
        if kind == "_supports_" and key == "reason":
            out["reason"] = str(value)
            continue
        if key not in keys:
            close = difflib.get_close_matches(str(key), keys, n=1)
            hint = f"did you mean {close[0]}?" if close else f"one of {', '.join(keys)}"
            raise InvalidPoint(f"{where}.{key} is not a key a variant can declare there ({hint})")
        if kind == "_fixed_":
            out[key] = _capability_value(where, key, value)
        else:
            values = value if isinstance(value, (list, tuple)) else [value]
            if not values:
                raise InvalidPoint(f"{where}.{key} lists no value")
            out[key] = tuple(_capability_value(where, key, v) for v in values)
    return out


@functools.lru_cache(maxsize=None)
def _class_declarations(cls: type) -> tuple[dict, dict]:
    where = f"{cls.__module__}.{cls.__qualname__}"
    return tuple(
        parse_declaration(getattr(cls, kind, None), f"{where}.{kind}", kind)
        for kind in DECLARATION_KEYS
    )


def _class(spec: VariantSpec) -> type:
    from harness.way.build import variant_class  # imports torch: only where a class is looked at

    return variant_class(spec)


def declarations(spec: VariantSpec) -> tuple[dict, dict]:
    """(supports, fixed) of the variant: its class's, overridden key by key by its yaml's."""
    supports, fixed = _class_declarations(_class(spec))
    return {**supports, **spec.supports}, {**fixed, **spec.fixed}


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
    reason = supports.get("reason")
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
                + (f" ({reason})" if reason else "")
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
