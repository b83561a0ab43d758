"""Model features, one module each: what a model computes besides plain multi-head attention
(ALiBi, attention sinks, packed sequences, a paged KV cache), each in one home
(docs/adding.md, "Adding a model feature").

A feature is a module of this package that defines ``FEATURE``, an instance of a ``Feature``
subclass. Everything the harness does differently for it is a hook of that object, so the point's
path loops over the active features instead of testing keys:

- the config: its keys (``keys``: each ``key(...)`` joins ``Point`` after the key it names), the
  values it adds to a core key's choices (``values``: a mask of its own), their validation and
  what they combine with (``check``), and when it is on (``active``);
- the module: what its constructor is handed (``argument``; a class that cannot take it is
  ``unsupported`` where the feature is ``required``, saying what it ``needs``); what a decode
  point's KV cache is made with (``cache_kwargs``, which the module's ``new_cache`` must take);
- the oracle: how nn.MultiheadAttention expresses it (``reference``: attributes and parameters
  of the float64 oracle; ``attn_mask``: the mask it defines; ``term``: what a module that does not
  compute it is handed in its float ``attn_mask``), the float masks nn.MHA holds for it
  (``handed``: the memory estimate), the query rows a sampled check must compare (``rows``);
- the diagnosis: its steps of nn.MHA's math (``steps``, run by harness/way/steps.py's ``Math``
  at a hook: ``bias`` adds (H, L, S) to the scores, ``column`` joins the softmax as a column dropped
  after it) and its known mistakes (``@FEATURE.mistake``), each replacing one step;
- the words: the progress line (``case``), the KV-cache factor (``cache``) and how findings name a
  factor's value (``title``).

The features are ordered as their first keys stand in ``Point``. Ground: a feature imports
nothing of the harness but the keys' vocabulary (harness/keys.py, harness/validate.py), because
harness/config.py reads its keys; and torch only at its first use (``torch`` below), because
reading results (``mha-bench report``) never imports it.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from dataclasses import dataclass
from typing import Callable


HOOKS = ("bias", "column")  # where ``Math`` runs a feature's step (harness/way/steps.py)


class _Torch:
    """torch, imported at its first use: the features' keys are read where no torch may be
    imported (reading results), their math runs where it is (a point's worker)."""

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
    # values it adds to a core key's choices, each with its help: {"mask": {"value": "help"}}
    values: dict = {}
    # its steps of nn.MHA's math: {step: (hook, right step)} (``HOOKS``; harness/way/steps.py)
    steps: dict = {}
    # where its constructor argument is missing from a class: unsupported (True), saying what it
    # ``needs``, or handed in the module's float attn_mask (False: ``term``)
    required: bool = False
    needs: str = ""
    handed: int = 0  # float (B*H, L, S) masks nn.MHA is handed for it (the memory estimate)
    # what a module's ``new_cache`` must take for it: the names of ``cache_kwargs``
    cache_arguments: tuple = ()

    def __init__(self):
        self.name = type(self).__module__.rpartition(".")[2]
        self.mistakes: list[Mistake] = []

    # ------------------------------------------------------------------------- the config
    def active(self, point) -> bool:
        """Whether the point has the feature on."""
        return False

    def check(self, point, set_) -> None:
        """Validate its keys and what they combine with (InvalidPoint naming the value); ``set_``
        normalises a value in the frozen point (a default that depends on another key)."""

    # ------------------------------------------------------------------------- the module
    def argument(self, point) -> dict:
        """What a module's constructor is handed for it, where the class takes it."""
        return {}

    def cache_kwargs(self, point) -> dict:
        """What a decode point's ``new_cache`` is handed besides style, batch, capacity, device
        and dtype (tensors on the CPU: the call moves them to the point's device)."""
        return {}

    # ------------------------------------------------------------------------- the oracle
    def reference(self, point, mha, gen) -> None:
        """nn.MHA (float64, its weights drawn) made to express the feature: attributes and
        parameters; ``gen`` draws what the feature needs, after every other weight."""

    def attn_mask(self, point, L: int, S: int):
        """(L, S) bool, True = may not attend: the mask the feature defines, or None."""
        return None

    def term(self, point, model, L: int, S: int, rows=None):
        """What ``model`` is handed in its float attn_mask for the feature (it has no argument
        for it), broadcastable to (H, L, S); None when it computes the feature itself. ``rows``:
        the queries' rows only (the oracle in query blocks)."""
        return None

    def rows(self, point) -> set:
        """Query rows a sampled check must compare (harness/way/compared.py)."""
        return set()

    # ------------------------------------------------------------------------- the words
    def case(self, row: dict) -> str:
        """Its words in a point's one-line case ("" when off), from a row."""
        return ""

    def cache(self, row: dict, style: str) -> str:
        """The KV-cache factor of a decode row (``style``: the row's kv_cache) as it says it."""
        return style

    def title(self, factor: str, value: str) -> str | None:
        """How findings name a factor's value it makes (None: not its value)."""
        return None

    # ------------------------------------------------------------------------- the diagnosis
    def mistake(self, step: str, says: str, fix: str, applies=None, name: str | None = None):
        """Register the decorated function as a mistake replacing ``step`` (a core step of
        harness/way/steps.py or one of ``steps``), shown where ``applies`` (default: where the
        feature is on)."""

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


def active(point) -> tuple[Feature, ...]:
    """The features the point has on."""
    return tuple(f for f in registry() if f.active(point))


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
