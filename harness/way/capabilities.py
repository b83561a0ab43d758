"""A variant's class before it is built: where it is (``locate``, ``variant_class``), which code
it is (``provenance``), and what it says it can do, applied to a point (``apply``).

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
import hashlib
import importlib
import inspect
from pathlib import Path
from typing import NamedTuple

from harness.config import InvalidPoint, Point, VariantSpec, choice_text
from harness.declarations import DECLARATION_KEYS, parse_declaration
from harness.way import kernels
from harness.way.build import distribution_of


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


def merged(first: dict, then: dict) -> dict:
    """Two ``_supports_`` (or ``_fixed_``) declarations, ``then``'s keys winning key by key, the
    reasons too: a subclass's, or a yaml's, adds to its base's without dropping the rest."""
    out = {**first, **then}
    if "reason" in first or "reason" in then:
        out["reason"] = {**first.get("reason", {}), **then.get("reason", {})}
    return out


def reason_of(supports: dict, key: str) -> str:
    """Why ``supports`` limits ``key`` ("" if it does not say); a kernel's is one text."""
    reason = supports.get("reason")
    return str(reason.get(key, "")) if isinstance(reason, dict) else str(reason or "")


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


def declarations(spec: VariantSpec) -> tuple[dict, dict]:
    """(supports, fixed) of the variant: its class's, overridden key by key by its yaml's."""
    supports, fixed = _class_declarations(variant_class(spec))
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
    hook = getattr(variant_class(point.variant), "kernel_supports", None)
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


class Admitted(NamedTuple):
    """A point as its variant runs it, before anything is built (``apply``)."""

    point: Point  # its fixed values in place of the asked ones
    fixed: str  # the ``fixed`` column: "bias=false (asked true)", "" when nothing changed
    refused: str | None  # why it is unsupported, or None
    kernel: kernels.Kernel | None  # the kernel of variants/kernels/ it runs, where it runs one
    cls: type  # the variant's class (``variant_class``), to build


def apply(point: Point) -> Admitted:
    """The point the variant runs (its fixed values in place of the asked ones), the ``fixed``
    column, why the point is unsupported (or None: by the variant's declaration, then its
    kernel's, variants/kernels/) and the kernel it runs. Raises InvalidPoint when the class
    cannot be imported or declares nonsense."""
    supports, fixed = declarations(point.variant)
    changes = {k: v for k, v in fixed.items() if value_of(point, k) != v}
    note = "; ".join(
        f"{k}={choice_text(v)} (asked {choice_text(value_of(point, k))})"
        for k, v in changes.items()
    )
    point = dataclasses.replace(point, **changes)
    refused = _refusal(point, supports, f"variant={point.variant.name}")
    cls = variant_class(point.variant)
    declared = None if refused else kernel_declaration(point)
    if declared is None:
        return Admitted(point, note, refused, None, cls)
    name, kernel_supports, missing = declared
    refused = missing or _refusal(point, kernel_supports, f"attention={name}")
    try:
        kernel = kernels.get(name)
    except ValueError:  # no kernel of that name: the constructor says so (invalid)
        kernel = None
    return Admitted(point, note, refused, kernel, cls)
