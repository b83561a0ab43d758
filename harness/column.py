"""One column of a table the harness writes (results.csv, effects.csv, effects_summary.csv): its
name, unit and meaning, defined once. A result row's columns are the fields of its record's typed
parts (harness/schema.py, harness/schema_check.py, harness/schema_timing.py), each declared with
``col(unit, meaning)`` as a config key is with ``key(default, help)`` (harness/keys.py); the
effects tables keep plain ``Column`` lists (harness/schema_effects.py)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Callable


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


class Part:
    """A typed part of a point's record (a frozen dataclass of ``col`` fields): what one stage of a
    point found. Its columns are flattened once, where the CSV is written (``Record.columns``)."""

    @classmethod
    def schema(cls) -> list[Column]:
        """The part's columns, in the CSV's order."""
        return [Column(f.name, **f.metadata) for f in fields(cls)]

    @classmethod
    def names(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    def columns(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def merged(self, later: "Part"):
        """This part with the fields ``later`` (a part of the same kind from a later stage) filled
        in over it."""
        return replace(self, **{k: v for k, v in later.columns().items() if v is not None})

    @classmethod
    def of(cls, row: dict):
        """The part as a row (an earlier run's, read back) has it."""
        return cls(**{f.name: row.get(f.name) for f in fields(cls)})
