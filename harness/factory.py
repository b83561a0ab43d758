"""The one point factory: a typed ``Point`` from Python (the API's ``make_point``, tests, scripts),
as ``mha-bench run variant=NAME key=value`` would compose it: the config's defaults, the variant's
yaml (conf/variant/NAME.yaml), a class or a dotted path, and the keys changed."""

from __future__ import annotations

from pathlib import Path

import yaml

from harness.declarations import DECLARATION_KEYS, parse_declaration
from harness.config import InvalidPoint, Point, VariantSpec, defaults, unknown_key_message

CONF_VARIANTS = Path(__file__).resolve().parent.parent / "conf" / "variant"


def _variant(variant, options: dict) -> tuple[str, dict]:
    """(name, the variant config: _target_ and options) for a class, a dotted path or a conf
    name."""
    if isinstance(variant, type):
        if "<locals>" in variant.__qualname__:
            raise InvalidPoint(
                f"variant={variant.__qualname__}: define the class at the top level of a "
                "module (the harness imports it by its dotted path)"
            )
        return variant.__name__, {
            "_target_": f"{variant.__module__}.{variant.__qualname__}",
            **options,
        }
    if not isinstance(variant, str):
        raise InvalidPoint(
            f"variant={variant!r} is not a class, a dotted path or a conf/variant name"
        )
    path = CONF_VARIANTS / f"{variant}.yaml"
    if "." not in variant and path.exists():
        return variant, {**yaml.safe_load(path.read_text()), **options}
    if "." not in variant:
        known = ", ".join(sorted(p.stem for p in CONF_VARIANTS.glob("*.yaml")))
        raise InvalidPoint(
            f"variant={variant!r} is not in conf/variant ({known}) nor a dotted path"
        )
    return variant.rsplit(".", 1)[-1], {"_target_": variant, **options}


def make_point(variant, /, **keys) -> Point:
    """The typed point, and the one place a point is made from Python (the API, tests, scripts):
    the config's defaults with ``keys`` changed, as ``mha-bench run variant=NAME key=value`` would.
    ``variant`` (``keys``' own ``variant`` dict) and ``timing``/``profiler`` dicts update the
    defaults' dicts; a ``variant`` dict with its own ``_target_`` replaces the variant's yaml."""
    raw = defaults()
    options = dict(keys.pop("variant", None) or {})
    for name, value in keys.items():
        raw[name] = (
            {**raw[name], **value}
            if isinstance(value, dict) and isinstance(raw.get(name), dict)
            else value
        )
    if "_target_" in options:
        name, raw["variant"] = _variant(variant, {})[0], options
    else:
        name, raw["variant"] = _variant(variant, options)
    return parse_point(raw, name)


def parse_point(raw: dict, variant_name: str) -> Point:
    """Validate a plain config dict (the composed config, resolved) into a ``Point``."""
    unknown = unknown_key_message(raw)
    if unknown:
        raise InvalidPoint(unknown)
    variant_cfg = dict(raw.get("variant") or {})
    target = variant_cfg.pop("_target_", None)
    if not target:
        raise InvalidPoint(f"variant={variant_name!r} has no _target_ in its config")
    declared = {
        kind: parse_declaration(
            variant_cfg.pop(kind, None), f"variant={variant_name}: {kind}", kind
        )
        for kind in DECLARATION_KEYS
    }
    spec = VariantSpec(
        name=variant_name,
        target=target,
        options=variant_cfg,
        supports=declared["_supports_"],
        fixed=declared["_fixed_"],
    )
    return Point(
        **{
            **raw,
            "variant": spec,
            "timing": dict(raw.get("timing") or {}),
            "profiler": dict(raw.get("profiler") or {}),
        }
    )
