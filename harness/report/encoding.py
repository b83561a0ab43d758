"""How a figure tells dozens of ways of writing attention apart: by their factors, not by a colour
per way (docs/architecture.md, "The report's figures").

A way is a set of factors (``effects.factors``: structure, kernel, head merge, compile, an SDPA
pin, a KV cache, an outside variant's own options). A figure encodes the factors that vary among
the hand-written ways: panels by the factor with the most values (the kernel first on a tie),
colour by structure, line style by compile, marker by head merge; a factor that would put more
than MAX_LINES lines in a panel becomes a row of panels, then a figure of its own. The shape keys
that vary besides the x axis take the panels left free, then figures of their own, so that no
mark averages two configurations. nn.MultiheadAttention (structure ``reference``) is a black line
in every panel: the line the others are read against.

Torch-free: pandas only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pandas as pd

from harness.report.effects import BASELINE_FIRST, MODEL_KEYS, factors
from harness.results import SHAPE_KEYS

MAX_LINES = 8  # lines in one panel, nn.MultiheadAttention's included
PREFIX = "factor."  # a way's factors as columns, apart from the row's own columns
REFERENCE = "reference"
# Which factor takes which encoding when it varies: the first listed that varies, else the one
# with the most values. The panel goes to the factor with the most values (ties: these first).
PANEL_FIRST = ("attention", "structure")
HUE_FIRST = ("structure",)
STYLE_FIRST = ("compile", "kv_cache", "sdpa_backend")
MARKER_FIRST = ("merge",)
MAX_STYLES, MAX_MARKERS = 4, 6  # line styles and markers a reader tells apart
MAX_COLS = 4  # panels in a row before they wrap
# The prepared rows' column of their kernel's place in the baseline order (report/analysis.py)
KERNEL_ORDER = "kernel_order"


def with_factors(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` with a ``factor.<name>`` column per way factor (the model's keys, K/V heads and
    mask, are shape keys here); a factor a row does not have reads "n/a"."""
    rows = [
        {k: v for k, v in factors(r).items() if k not in MODEL_KEYS} for r in df.to_dict("records")
    ]
    table = pd.DataFrame(rows, index=df.index).fillna("n/a").astype(str)
    for always in ("structure", "compile"):  # every way has them, even among no rows
        if always not in table:
            table[always] = pd.Series(dtype=str)
    table.columns = [PREFIX + c for c in table.columns]
    return pd.concat([df.drop(columns=[c for c in table.columns if c in df]), table], axis=1)


def name(column: str) -> str:
    return column[len(PREFIX) :] if column.startswith(PREFIX) else column


def is_reference(df: pd.DataFrame) -> pd.Series:
    return df[PREFIX + "structure"] == REFERENCE


@dataclass
class Encoding:
    """Columns of a ``with_factors`` frame, each drawn one way; ``split``: a figure per value."""

    col: str | None = None
    row: str | None = None
    hue: str | None = None
    style: str | None = None
    marker: str | None = None
    split: list[str] = field(default_factory=list)

    def in_panel(self) -> list[str]:
        return [k for k in (self.hue, self.style, self.marker) if k]

    def panels(self) -> list[str]:
        return [k for k in (self.col, self.row) if k]


def _first(keys: list[str], preferred: tuple, levels: dict, limit: int | None) -> str | None:
    fits = [k for k in keys if limit is None or levels[k] <= limit]
    for p in preferred:
        if PREFIX + p in fits:
            return PREFIX + p
    return fits[0] if fits else None


def _rank(column: str, order: tuple) -> int:
    return order.index(name(column)) if name(column) in order else len(order)


def encode(data: pd.DataFrame, x: str, panel: str | None = None) -> Encoding:
    """The encoding of ``data`` (a ``with_factors`` frame) along ``x``: at most MAX_LINES lines
    in a panel where the factors allow it. ``panel`` names a factor to give the panels to when it
    varies (the kernel, for "what does X buy per kernel")."""
    ours = data[~is_reference(data)]
    refs = data.loc[is_reference(data), "way"].nunique() if "way" in data else 0
    levels = {
        c: ours[c].nunique() for c in data.columns if c.startswith(PREFIX) and ours[c].nunique() > 1
    }
    keys = sorted(levels, key=lambda k: (-levels[k], _rank(k, PANEL_FIRST)))
    facets: list[str] = []
    if panel and PREFIX + panel in levels:
        facets.append(PREFIX + panel)
    elif keys and combos(ours, keys) + refs > MAX_LINES:
        facets.append(keys[0])
    rest = [k for k in keys if k not in facets]
    enc = Encoding()
    enc.hue = _first(rest, HUE_FIRST, levels, None)
    rest = [k for k in rest if k != enc.hue]
    enc.style = _first(rest, STYLE_FIRST, levels, MAX_STYLES)
    rest = [k for k in rest if k != enc.style]
    enc.marker = _first(rest, MARKER_FIRST, levels, MAX_MARKERS)
    facets += [k for k in rest if k != enc.marker]

    def lines() -> int:
        return combos(ours, enc.in_panel()) + refs

    while lines() > MAX_LINES and enc.in_panel():  # the least telling encoding leaves first
        for attr in ("marker", "style", "hue"):
            if getattr(enc, attr):
                facets.append(getattr(enc, attr))
                setattr(enc, attr, None)
                break
    facets += shape_splits(data, [x, *keys])
    enc.col, enc.row = (facets + [None, None])[:2]
    enc.split = facets[2:]
    return enc


def combos(ours: pd.DataFrame, keys: list[str]) -> int:
    """How many lines ``keys`` draw: the combinations of their values that the rows have."""
    return len(ours[keys].drop_duplicates()) if keys and len(ours) else min(len(ours), 1)


def shape_splits(data: pd.DataFrame, encoded: list[str]) -> list[str]:
    """Shape keys that vary among rows that the ``encoded`` columns would draw in one place,
    in SHAPE_KEYS' order. A key that the others determine (kv_seq_len = seq_len without
    cross-attention, window with mask) is not added again."""
    out: list[str] = []
    encoded = [k for k in encoded if k in data.columns]
    for key in SHAPE_KEYS:
        if key in encoded or key not in data.columns:
            continue
        values = key_text(data, key)
        by = [key_text(data, k) for k in encoded + out]
        counts = values.groupby(by).nunique() if by else pd.Series([values.nunique()])
        if len(counts) and counts.max() > 1:
            out.append(key)
    return out


def key_text(data: pd.DataFrame, key: str) -> pd.Series:
    """``data[key]`` as text for grouping. The keys' length where it follows from the queries'
    (seq_len, plus the cache when decoding) reads "seq_len" or "seq_len+kv_cache_len": it moves
    with a figure's x axis and so is no configuration of its own."""
    if key != "kv_seq_len" or "seq_len" not in data:
        return text(data[key])
    cache = data["kv_cache_len"].fillna(0) if "kv_cache_len" in data else 0
    derived = (data[key] == data["seq_len"]) | (data[key] == data["seq_len"] + cache)
    return text(data[key]).where(~derived, "from seq_len")


def text(series: pd.Series) -> pd.Series:
    """Values as text for grouping: 2048.0 reads 2048, a missing value "n/a"."""
    return series.map(plain)


def plain(value) -> str:
    """A value as a person writes it: 2048, not 2048.0 (a column with missing values is float);
    a missing value is "n/a"."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def label(column: str, value) -> str:
    """``attention=sdpa``: a panel's or figure's title part."""
    return f"{name(column)}={plain(value)}"


def order(values, ranks: dict | None = None) -> list:
    """Levels in reading order: numbers ascending, otherwise the factors' baseline first (off
    before compile, view before reshape), then by ``ranks`` (``ranks_of``: the kernels in their
    baseline order), then alphabetical."""
    vals = list(dict.fromkeys(values))
    ranks = ranks or {}
    try:
        return sorted(vals, key=lambda v: float(v))
    except (TypeError, ValueError):
        known = [v for lst in BASELINE_FIRST.values() for v in lst]
        return sorted(
            vals,
            key=lambda v: (
                known.index(v) if v in known else len(known),
                ranks.get(str(v), math.inf),
                str(v),
            ),
        )


def ranks_of(data: pd.DataFrame, column: str) -> dict:
    """Each value of ``column``'s place in its baseline order where it is the attention factor:
    the run's kernels' own ``order`` (the prepared rows' ``kernel_order``, from ways.json)."""
    if name(column) != "attention" or KERNEL_ORDER not in data or column not in data:
        return {}
    return data.groupby(data[column].astype(str))[KERNEL_ORDER].min().to_dict()
