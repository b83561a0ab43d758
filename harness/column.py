"""One column of a table the harness writes (results.csv, effects.csv, effects_summary.csv): its
name, unit and meaning, defined once (harness/schema.py, harness/schema_check.py,
harness/schema_effects.py hold the lists)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Column:
    name: str
    unit: str  # unit, or the kind of value (name, text, bool, count)
    meaning: str  # one line for docs/reference.md (Markdown)
    table: bool = False  # shown in the report's table of every row
    rounds: bool = False  # filled in by the timing rounds: a resumed point gets these anew
    compute: Callable[[dict], object] | None = None  # the value from the row's other columns
