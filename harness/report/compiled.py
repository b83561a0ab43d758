"""Compile time by structure and kernel: one compact table (the first call's seconds, and
recompiles), not a bar per point. Each cell gathers the points of one structure and kernel
(and compile mode): the median with the range and the count, so that no shape is hidden in a
mean; recompiles are summed, since one anywhere means a shape or guard was not reused.
"""

from __future__ import annotations

import pandas as pd

from harness.report.encoding import (
    PREFIX,
    is_reference,
    name,
    order,
    ranks_of,
    shape_splits,
    text,
    with_factors,
)
from harness.results import number

STRUCTURE_NAMES = {"reference": "nn.MultiheadAttention"}
# The table's columns: this factor when it varies, else the factor with the most values.
KERNEL_FIRST = ("attention",)


def compile_table(rows: pd.DataFrame) -> dict | None:
    """{"kernel": column factor, "columns": its values, "rows": [{"label", "cells"}], "over": the
    keys a cell gathers}; None when no row has a compile time."""
    if "compile_s" not in rows.columns or not rows["compile_s"].notna().any():
        return None
    data = with_factors(rows[rows["compile_s"].notna()])
    ours = data[~is_reference(data)]
    varying = [
        c
        for c in data.columns
        if c.startswith(PREFIX)
        and name(c) not in ("structure", "compile")
        and ours[c].nunique() > 1
    ]
    kernel = next((PREFIX + k for k in KERNEL_FIRST if PREFIX + k in varying), None)
    if kernel is None and varying:
        kernel = max(varying, key=lambda c: ours[c].nunique())
    keys = [PREFIX + "structure"]
    if data[PREFIX + "compile"].nunique() > 1:
        keys.append(PREFIX + "compile")
    columns = order(text(ours[kernel]), ranks_of(ours, kernel)) if kernel else ["all"]
    if kernel and is_reference(data).any():
        columns.append("n/a")  # nn.MultiheadAttention has no kernel factor
    out_rows = []
    for values, group in data.groupby(keys, sort=False):
        values = values if isinstance(values, tuple) else (values,)
        cells = []
        for col in columns:
            part = group[text(group[kernel]) == col] if kernel else group
            seconds = part["compile_s"].map(number).dropna()
            if seconds.empty:
                cells.append(None)
                continue
            recompiles = part["recompiles"].map(number).dropna() if "recompiles" in part else []
            cells.append(
                dict(
                    median=float(seconds.median()),
                    low=float(seconds.min()),
                    high=float(seconds.max()),
                    n=len(seconds),
                    recompiles=int(sum(recompiles)),
                )
            )
        label = " · ".join(
            (STRUCTURE_NAMES.get(v, v) if name(k) == "structure" else f"{name(k)}={v}")
            for k, v in zip(keys, values)
        )
        recompiles = sum(c["recompiles"] for c in cells if c)
        out_rows.append(dict(label=label, cells=cells, recompiles=recompiles, order=tuple(values)))
    ranks = {k: order(text(data[k]).unique(), ranks_of(data, k)) for k in keys}
    out_rows.sort(key=lambda r: [ranks[k].index(v) for k, v in zip(keys, r.pop("order"))])
    factors = [c for c in data.columns if c.startswith(PREFIX) and c not in (*keys, kernel)]
    gathered = [name(c) for c in factors if data[c].nunique() > 1]
    gathered += shape_splits(data, [*keys, *([kernel] if kernel else []), *factors])
    return dict(
        kernel=name(kernel) if kernel else "",
        columns=["nn.MHA" if c == "n/a" else c for c in columns],
        rows=out_rows,
        over=gathered,
    )
