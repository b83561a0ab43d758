"""The report's seaborn figures, each a function of the rows returning an inlined PNG (base64)
or None when the rows cannot make that figure (too few points, column missing).

pandas 3 string columns break seaborn 0.13.2's ``hue_order``: every column used for hue,
style, row or col is made a Categorical first (``_categorical``).
"""

from __future__ import annotations

import base64
import io

import matplotlib

matplotlib.use("Agg")  # no display; must precede pyplot
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402

MAX_PANELS = 6  # figures per kind, so a huge sweep still renders in seconds


def png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _categorical(series: pd.Series) -> pd.Categorical:
    values = series.map(lambda v: "n/a" if pd.isna(v) else str(v)).astype(object)
    return pd.Categorical(values, categories=sorted(values.unique()))


def _prepare(df: pd.DataFrame, *cats: str) -> pd.DataFrame:
    out = df.copy()
    for c in cats:
        if c in out.columns:
            out[c] = _categorical(out[c])
    return out


def _groups(timed: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    """Split rows that should not share a line: one figure per (mode, batch, embed_dim)."""
    keys = [k for k in ("mode", "batch", "embed_dim") if k in timed.columns]
    if not keys:
        return [("", timed)]
    out = []
    for values, group in timed.groupby(keys, sort=True, observed=True, dropna=False):
        values = values if isinstance(values, tuple) else (values,)
        out.append((" ".join(f"{k}={v}" for k, v in zip(keys, values)), group))
    return out[:MAX_PANELS]


def line_vs_seq_len(timed: pd.DataFrame, y: str, ylabel: str, logy: bool = True) -> list[tuple[str, str]]:
    """``y`` vs seq_len, a line per way of writing, panels by dtype (cols) and num_heads (rows),
    mask as line style; one figure per (mode, batch, embed_dim)."""
    timed = timed[timed[y].notna()] if y in timed.columns else timed.iloc[0:0]
    figures = []
    for title, group in _groups(timed):
        if group.empty:
            continue
        data = _prepare(group, "way", "dtype", "num_heads", "mask")  # missing values: category "n/a"
        style = "mask" if data["mask"].nunique() > 1 else None
        g = sns.relplot(
            data=data, x="seq_len", y=y, hue="way", style=style, col="dtype",
            row="num_heads" if data["num_heads"].nunique() > 1 else None,
            kind="line", marker="o", errorbar=None, height=3.0, aspect=1.3,
            facet_kws={"sharey": False, "margin_titles": True},
        )
        g.set(xscale="log")
        if logy:
            g.set(yscale="log")
        g.set_axis_labels("seq_len (tokens)", ylabel)
        if title:
            g.figure.suptitle(title, y=1.02)
        figures.append((title, png(g.figure)))
    return figures


def speedup_heatmap(speedups: pd.DataFrame) -> str | None:
    """Ways of writing (rows) x shapes (columns): reference latency / latency; >1 is faster."""
    if speedups.empty or speedups.shape[1] == 0:
        return None
    width = min(30, 2 + 0.7 * speedups.shape[1])
    height = min(20, 1.5 + 0.45 * speedups.shape[0])
    fig, ax = plt.subplots(figsize=(width, height))
    sns.heatmap(np.log2(speedups.astype(float)), annot=speedups.astype(float), fmt=".2f", cmap="RdBu",
                center=0, cbar_kws={"label": "log2 speedup over nn.MultiheadAttention"}, ax=ax,
                annot_kws={"fontsize": 7})
    ax.set_xlabel("shape")
    ax.set_ylabel("")
    ax.tick_params(axis="x", labelrotation=90, labelsize=7)
    return png(fig)


def compile_bars(rows: pd.DataFrame) -> str | None:
    """Compile time (first call, compilation included) per way of writing and mode."""
    if "compile_s" not in rows.columns:
        return None
    data = rows[rows["compile_s"].notna()]
    if data.empty:
        return None
    data = _prepare(data, "way", "mode")
    g = sns.catplot(data=data, x="compile_s", y="way", hue="mode", kind="bar", errorbar=None,
                    height=0.4 * data["way"].nunique() + 1.5, aspect=2.2)
    g.set_axis_labels("compile time, first call (s)", "")
    return png(g.figure)
