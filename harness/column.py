"""One column of a table the harness writes (results.csv, effects.csv, effects_summary.csv): its
name, unit and meaning, defined once. A result row's columns are the fields of its record's typed
parts (harness/schema.py, harness/schema_check.py, harness/schema_timing.py), each declared with
``col(unit, meaning)`` as a config key is with ``key(default, help)`` (harness/keys.py), or, for a
figure with its 95% interval (``Interval``), with ``interval(...)``: one field, three columns;
the effects tables keep plain ``Column`` lists (harness/schema_effects.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Callable


@dataclass(frozen=True)
class Interval:
    """A figure and its 95% interval (harness/measure/stats.py makes them)."""

    center: float  # the geometric mean of the values
    low: float  # 95% interval (NaN with fewer than 2 values)
    high: float
    n: int

    @property
    def rel_halfwidth(self) -> float:
        """Half the interval's width relative to its centre (0.05 = ±5%)."""
        if not self.center or math.isnan(self.low):
            return math.inf
        return (self.high - self.low) / 2 / self.center

    def overlaps(self, other: "Interval") -> bool:
        return self.low <= other.high and other.low <= self.high


NAN = Interval(math.nan, math.nan, math.nan, 0)


@dataclass(frozen=True)
class Column:
    name: str
    unit: str  # unit, or the kind of value (name, text, bool, count)
    meaning: str  # one line for docs/reference.md (Markdown)
    table: bool = False  # shown in the report's table of every row
    rounds: bool = False  # filled in by the timing rounds: a resumed point gets these anew
    compute: Callable[[dict], object] | None = None  # the value from the row's other columns


def col(
    unit: str,
    meaning: str,
    table: bool = False,
    rounds: bool = False,
    compute: Callable[[dict], object] | None = None,
):
    """A column of a record's part: a field, empty (None) until its stage fills it, that carries
    its unit and meaning (``Part.schema``)."""
    metadata = dict(unit=unit, meaning=meaning, table=table, rounds=rounds, compute=compute)
    return field(default=None, metadata=metadata)


def interval(
    unit: str,
    center: str,
    meaning: str,
    bounds: str,
    table: bool = False,
    table_bounds: bool | None = None,
    rounds: bool = False,
):
    """A figure with its 95% interval (an ``Interval`` field, empty: None): three columns of the
    row, ``center`` (``latency_ms_median``: ``meaning``) and its bounds, named after the center
    less ``_median``, ``latency_ms_ci_low`` and ``latency_ms_ci_high`` (``bounds``: their
    meaning); ``table_bounds``: the bounds in the report's table (default: as ``table``)."""
    prefix = center.removesuffix("_median")
    names = (center, f"{prefix}_ci_low", f"{prefix}_ci_high")
    shown = table if table_bounds is None else table_bounds
    cols = (
        Column(names[0], unit, meaning, table, rounds),
        *(Column(n, unit, bounds, shown, rounds) for n in names[1:]),
    )
    return field(default=None, metadata=dict(interval=cols))


def _cell(x):
    """An interval's value as its column has it: NaN (too few rounds) is empty."""
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else x


class Part:
    """A typed part of a point's record (a frozen dataclass of ``col`` and ``interval`` fields):
    what one stage of a point found. Its columns are flattened once, where the CSV is written
    (``Record.columns``)."""

    @classmethod
    def schema(cls) -> list[Column]:
        """The part's columns, in the CSV's order (an interval's three where it stands)."""
        out = []
        for f in fields(cls):
            single = [Column(f.name, **f.metadata)] if "interval" not in f.metadata else []
            out += list(f.metadata.get("interval", ())) + single
        return out

    @classmethod
    def names(cls) -> set[str]:
        return {c.name for c in cls.schema()}

    def columns(self) -> dict:
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if "interval" not in f.metadata:
                out[f.name] = value
                continue
            parts = (None,) * 3 if value is None else (value.center, value.low, value.high)
            out.update(zip((c.name for c in f.metadata["interval"]), map(_cell, parts)))
        return out

    def merged(self, later: "Part"):
        """This part with the fields ``later`` (a part of the same kind from a later stage) filled
        in over it."""
        return replace(self, **{k: v for k, v in later.columns().items() if v is not None})

    @classmethod
    def of(cls, row: dict):
        """The part as a row (an earlier run's, read back) has it."""
        return cls(**{f.name: _read(f, row) for f in fields(cls)})


def _read(f, row: dict):
    """A field's value from a row: an interval from its three columns (None where it has none)."""
    if "interval" not in f.metadata:
        return row.get(f.name)
    values = [row.get(c.name) for c in f.metadata["interval"]]
    if all(_cell(v) is None for v in values):
        return None
    return Interval(*(math.nan if _cell(v) is None else float(v) for v in values), 0)
