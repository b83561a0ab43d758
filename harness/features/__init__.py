"""Model features, one module each: a module of this package that defines ``FEATURE``, a
``Feature`` whose hooks say everything the harness does differently for it, so that a point's
path loops over its active features instead of testing keys (docs/adding.md, "Adding a model
feature").

Ground: a feature imports only the keys' vocabulary (harness/keys.py, harness/validate.py), as
harness/config.py reads its keys, the work models' conventions (harness/flops.py), and torch at
its first use (``torch`` below), as reading results never imports it. The features go in the
order their first keys stand in ``Point``.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from dataclasses import dataclass
from typing import Callable


HOOKS = ("qk", "bias", "column")  # where ``Math`` runs a feature's step (harness/way/steps.py)


class _Torch:
    """torch, imported at its first use (a feature's math runs in a point's worker)."""

    def __getattr__(self, name: str):
        import torch as real

        return getattr(real, name)


torch = _Torch()


@dataclass(frozen=True)
class Mistake:
    """A known mistake: nn.MHA's math with one step done wrong (harness/way/steps.py)."""

    name: str  # the id in the row's ``diagnosis`` column
    step: str  # the step it replaces
    fn: Callable  # the wrong step, with the right step's signature
    says: str  # what the module computes: "nn.MHA with <says>"
    fix: str  # what to change, one line
    applies: Callable  # applies(point) -> bool: the points where it can show at all


class Feature:
    """A model feature's hooks; each default does nothing, so a feature defines what it needs."""

    keys: dict = {}  # config keys it adds: {name: key(..., after=KEY)} (harness/keys.py)
    values: dict = {}  # values it adds to a core key's choices: {"mask": {"value": "its help"}}
    # its steps of nn.MHA's math: {step: (hook, right step)} (``HOOKS``; harness/way/steps.py)
    steps: dict = {}
    # core steps it computes its own way (latent attention's projection): their mistakes, which
    # are of nn.MHA's way, do not apply where it is on (its own say what goes wrong there)
    replaces: tuple = ()
    # a class that takes no ``argument``: unsupported, saying what it ``needs`` (True), or handed
    # the feature in its float attn_mask (False: ``term``)
    required: bool = False
    needs: str = ""
    handed: int = 0  # float (B*H, L, S) masks nn.MHA is handed for it (the memory estimate)
    cache_arguments: tuple = ()  # what a module's ``new_cache`` must take: ``cache_kwargs``'s
    # points (their keys) where each of its mistakes shows: tests/test_diagnosis.py plants them
    examples: tuple = ()

    def __init__(self):
        self.name = type(self).__module__.rpartition(".")[2]
        self.mistakes: list[Mistake] = []

    def active(self, point) -> bool:  # the point has it on
        return False

    def check(self, point, set_) -> None:
        """Validate its keys and what they combine with (InvalidPoint naming the value); ``set_``
        puts a value in the frozen point (a default that depends on another key)."""

    def argument(self, point) -> dict:  # what a module's constructor is handed for it
        return {}

    def cache_kwargs(self, point) -> dict:  # more for a decode point's ``new_cache`` (CPU)
        return {}

    def reference(self, point, mha, gen) -> None:
        """nn.MHA (float64, its weights drawn) made to express it; ``gen`` draws what it needs."""

    def attn_mask(self, point, L: int, S: int):  # (L, S) bool, True = may not attend, or None
        return None

    def term(self, point, model, L: int, S: int, rows=None, like=None):
        """What ``model`` is handed in its float attn_mask for it, broadcastable to (H, L, S);
        None where it computes it itself. ``rows``: those queries' only (the oracle's blocks).
        ``like``: a tensor on the device, and of the dtype, the term is made for (the module's
        query: a large term is built where it is used, not whole in float64 on the host; None:
        float64 on the CPU)."""
        return None

    def held(self, point) -> int:
        """Elements the point's variant holds for it beyond harness/way/footprint.py's count
        (a paged cache's whole pool), so that the memory estimate refuses a point that cannot
        fit before it asks the allocator."""
        return 0

    def work(self, point) -> tuple[float, float | None] | None:
        """Its own work model where the feature changes the work: one call's FLOPs and a decode
        step's least bytes (None off decode), in harness/flops.py's conventions; None: nn.MHA's
        dense model stands."""
        return None

    def rows(self, point) -> set:  # query rows a sampled check must compare
        return set()

    def case(self, row: dict) -> str:  # its words in a point's one-line case ("" when off)
        return ""

    def cache(self, row: dict, style: str) -> str:  # a decode row's KV-cache factor, as it says
        return style

    def title(self, factor: str, value: str) -> str | None:  # a factor's value it makes, named
        return None

    def mistake(self, step: str, says: str, fix: str, applies=None, name: str | None = None):
        """Register the decorated function as a known mistake replacing ``step`` (a core step of
        harness/way/steps.py or one of ``steps``), where ``applies`` (default: ``active``)."""

        def register(fn):
            shown = applies or self.active
            self.mistakes.append(Mistake(name or fn.__name__, step, fn, says, fix, shown))
            return fn

        return register


@functools.lru_cache(maxsize=None)
def _found() -> tuple[Feature, ...]:
    """Every feature of this package (its modules that define ``FEATURE``), by module name."""
    found = []
    for info in pkgutil.iter_modules(__path__):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        feature = getattr(module, "FEATURE", None)
        if not isinstance(feature, Feature):
            raise TypeError(f"{module.__name__} defines no FEATURE (a Feature)")
        found.append(feature)
    return tuple(found)


_ORDER: list[str] = []  # the config's keys, once ``keyed`` has made them: the features' order


def registry() -> tuple[Feature, ...]:
    """Every feature, in the order their first keys stand in the config (those without keys
    last, by name): the order of their words on a point's line and of their mistakes."""
    return _ordered(tuple(_ORDER))


@functools.lru_cache(maxsize=None)
def _ordered(order: tuple) -> tuple[Feature, ...]:
    def at(feature: Feature) -> int:
        names = [n for n in feature.keys if n in order]
        return order.index(names[0]) if names else len(order)

    return tuple(sorted(_found(), key=at))


# Set on a built module (harness/way/build.py): the names of the features' arguments its class was
# handed. A class that takes a feature's argument computes the feature itself, whatever
# attributes it keeps (docs/adding.md): a BLOOM adapter that took ALiBi's argument but kept no
# attribute of that name was handed the bias a second time in its mask.
HANDED = "_mha_bench_handed"


def computes(model, *names: str) -> bool:
    """Whether ``model`` was handed the arguments ``names`` (it computes their feature itself)."""
    return set(names) <= getattr(model, HANDED, frozenset())


def active(point) -> tuple[Feature, ...]:
    """The features the point has on."""
    return tuple(f for f in registry() if f.active(point))


def work(point) -> tuple[float, float | None] | None:
    """The work model of the first active feature that has its own (``Feature.work``), or None."""
    return next((w for f in active(point) if (w := f.work(point)) is not None), None)


def keyed(cls):
    """``cls`` (harness/config.py's ``Point``, before ``@dataclass``) with every feature's keys:
    each after the key its ``after`` names (a core key or another feature's), behind the keys
    placed there before it (by module name); a key whose anchor no key has goes last."""
    names = list(cls.__dict__.get("__annotations__", {}))
    last: dict = {}  # an anchor -> the key placed after it last
    waiting = [(n, f) for feature in _found() for n, f in feature.keys.items()]
    while waiting:
        ready = [(n, f) for n, f in waiting if f.metadata.get("after") in names] or waiting[:1]
        for name, f in ready:
            anchor = f.metadata.get("after")
            after = last.get(anchor, anchor)
            names.insert(names.index(after) + 1 if after in names else len(names), name)
            last[anchor] = name
            setattr(cls, name, f)
        waiting = [w for w in waiting if w[0] not in names]
    annotations = cls.__dict__.get("__annotations__", {})
    cls.__annotations__ = {n: annotations.get(n, "object") for n in names}
    _ORDER[:] = names
    return cls


def choices(key: str, core: tuple) -> tuple:
    """A core key's values and those the features add (``Feature.values``)."""
    return core + tuple(v for f in _found() for v in f.values.get(key, {}))


def said(key: str) -> str:
    """What the features' values of a core key mean, for its help: "; value: help"."""
    return "".join(f"; {v}: {h}" for f in _found() for v, h in f.values.get(key, {}).items())


def numeric(value) -> float:
    """A row's cell as a float: NaN where it is empty, missing or not a number."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return float("nan")


def shown(row: dict, key: str, default=None):
    """A row's value of ``key`` where it says something (present, not NaN, not ``default``)."""
    value = row.get(key)
    if value is None or value == default or (isinstance(value, float) and value != value):
        return None
    return value


def case(row: dict) -> str:
    """The features' words on a point's one-line case (harness/progress.py)."""
    return "".join(f.case(row) for f in registry())


def cache(row: dict, style: str) -> str:
    """A decode row's KV-cache factor: ``style`` as the features say it (with a page size)."""
    for feature in registry():
        style = feature.cache(row, style)
    return style


def title(factor: str, value: str) -> str | None:
    """How findings name a factor's value that a feature makes, or None."""
    for feature in registry():
        said = feature.title(factor, value)
        if said is not None:
            return said
    return None


def mistakes() -> list[Mistake]:
    """Every feature's known mistakes, in the features' order."""
    return [m for f in registry() for m in f.mistakes]
