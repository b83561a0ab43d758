"""peak.json at the run/sweep root, read: the peaks a sweep measured (harness/measure/roofline.py
measures them), and every row's % of peak set against the final file. Torch-free: the sweep's
own process applies them to results.csv without importing torch."""

from __future__ import annotations

import json
import logging
from pathlib import Path

log = logging.getLogger("harness")


def read_peaks(path: Path | None) -> dict:
    """peak.json's peaks by key. A damaged file (cut short, edited, not JSON) holds none: it is
    said, and the peaks are measured again where a point needs one."""
    if path is None or not path.exists():
        return {}
    try:
        peaks = json.loads(path.read_text())
        if isinstance(peaks, dict):
            return {k: v for k, v in peaks.items() if isinstance(v, dict)}
        problem = "not a table of peaks"
    except (OSError, ValueError) as e:
        problem = str(e)
    log.warning(f"warning: {path} is damaged ({problem}): its peaks are measured again")
    return {}


def apply_peaks(df, path: Path):
    """Every row's ``peak_tflops`` and ``pct_of_peak`` against the sweep's final peak.json: a
    peak raised late in a sweep (re-measured, or beaten) applies to the rows written before."""
    if df.empty or "tflops" not in df.columns:
        return df
    peaks = read_peaks(path)
    df = df.copy()
    keys = [f"{n} | {d} | {t}" for n, d, t in zip(df["device_name"], df["device"], df["dtype"])]
    peak = [peaks.get(k, {}).get("tflops") for k in keys]
    has = [p is not None and t == t and t is not None for p, t in zip(peak, df["tflops"])]
    df.loc[has, "peak_tflops"] = [p for p, h in zip(peak, has) if h]
    df.loc[has, "pct_of_peak"] = (
        100 * df.loc[has, "tflops"].astype(float) / df.loc[has, "peak_tflops"].astype(float)
    )
    return df
