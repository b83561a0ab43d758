"""The language a variant declares its abilities in: ``_supports_`` and ``_fixed_``, their keys and
values checked like the config's own (``parse_declaration``). Ground: the point factory and the
sweeper read declarations too; harness/way/capabilities.py applies them to a point.
"""

from __future__ import annotations

import dataclasses
import difflib

from harness.config import InvalidPoint, Point, choice_text, choices_of, is_choice

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
    """``_supports_`` -> {key: tuple of allowed values, "reason": {key: why}}; ``_fixed_`` ->
    {key: value}. A ``reason`` is one text for every key of its declaration, or a mapping of
    keys to their own (``reason: {mask: "...", cross: "..."}``). ``where`` names the
    declaration in messages, e.g. "variant=mine: _supports_"."""
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
    reason = raw.get("reason") if kind == "_supports_" else None
    for key, value in raw.items():
        if kind == "_supports_" and key == "reason":
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
    if isinstance(reason, dict):
        stray = sorted(set(reason) - set(out))
        if stray:
            raise InvalidPoint(f"{where}.reason names {', '.join(map(str, stray))}, not declared")
        out["reason"] = {k: str(v) for k, v in reason.items()}
    elif reason is not None:
        out["reason"] = {k: str(reason) for k in out}
    return out
