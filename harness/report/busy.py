"""Which rows were timed on a busy machine, and the sentence that says so.

The measurement side marks a point ``contended`` when other processes kept spoiling its timing
rounds even after re-timing them (harness/schema.py: ``contended``, ``busy_cores``, ``cores``,
``cpu_wait``, ``contention``). Such a row's figures decide nothing: the ranking names no winner
at its shape, its effect pairs get the verdict ``busy`` and are left out of every summary,
compare does not judge it, and the findings open with ``busy_line``. Rows from before those
columns are not contended.

Torch-free: pandas only.
"""

from __future__ import annotations

import math

import pandas as pd

from harness.measure.contention import SPOILED_WAIT
from harness.results import timed_ok

TRUE = {"true", "1", "1.0", "yes"}


def flag(value) -> bool:
    """One ``contended`` cell as a bool: True, 1 and the texts "True"/"true"/"1" are; an empty
    cell (None, NaN), False, 0 and anything else are not."""
    if value is None or isinstance(value, float) and math.isnan(value):
        return False
    if isinstance(value, str):
        return value.strip().lower() in TRUE
    try:
        return bool(value)
    except (TypeError, ValueError):
        return False


def contended(df: pd.DataFrame) -> pd.Series:
    """Each row's ``contended`` as bools (all False where the column is missing: older runs)."""
    if "contended" not in df.columns:
        return pd.Series(False, index=df.index, dtype=bool)
    return df["contended"].map(flag).astype(bool)


def busy_rows(rows: pd.DataFrame | None) -> tuple[pd.DataFrame, int]:
    """(the correct timed rows that stayed contended, how many correct timed rows there are)."""
    if rows is None or rows.empty:
        return pd.DataFrame(), 0
    timed = timed_ok(rows)
    return timed[contended(timed)], len(timed)


def _median(rows: pd.DataFrame, column: str) -> float:
    if column not in rows.columns:
        return math.nan
    values = pd.to_numeric(rows[column], errors="coerce").dropna()
    return float(values.median()) if len(values) else math.nan


def _said(rows: pd.DataFrame | None) -> tuple[str, str, float]:
    """(how busy, e.g. "other processes used 1.6 of 2 cores", or "" where the rows do not say;
    "12 of 144 points stayed contended after re-timing", or "" when none did; the contended
    rows' largest num_threads)."""
    busy, n = busy_rows(rows)
    if busy.empty:
        return "", "", math.nan
    used, cores = _median(busy, "busy_cores"), _median(busy, "cores")
    how = ""
    if not math.isnan(used):
        of = "" if math.isnan(cores) else f" of {cores:.0f}"
        how = f"other processes used {used:.1f}{of} cores"
    count = f"{len(busy)} of {n} points stayed contended after re-timing"
    threads = (
        pd.to_numeric(busy["num_threads"], errors="coerce").max()
        if "num_threads" in busy.columns
        else math.nan
    )
    return how, count, float(threads)


def busy_detail(rows: pd.DataFrame | None, during: str = "these rounds") -> str:
    """How busy the machine was during the contended rows' rounds: "other processes used 1.6 of
    2 cores during these rounds (12 of 144 points stayed contended after re-timing)"; empty
    when no correct timed row is contended."""
    how, count, _ = _said(rows)
    if not count:
        return ""
    return f"{how or 'the machine was busy'} during {during} ({count})"


def busy_line(rows: pd.DataFrame | None) -> str:
    """One sentence when some correct timed row is contended (else ""): how busy the machine
    was, how many points that spoiled, and what to do (fewer threads only where more than one
    ran)."""
    how, count, threads = _said(rows)
    if not count:
        return busy_but_clean(rows)
    fix = "re-run on a quiet machine" + (" or with num_threads=1" if threads > 1 else "")
    said = f"{how} during these rounds" if how else "during these rounds"
    return (
        f"the machine was busy{':' if how else ''} {said} ({count}); their figures decide "
        f"nothing here: {fix}."
    )


# Other processes' cores (median over the timed rows) from which a run that stayed clean is still
# said to have run on a busy machine: its reader should know, and know why its figures stand.
BUSY_CORES = 0.5


def busy_but_clean(rows: pd.DataFrame | None) -> str:
    """When no row stayed contended but other processes kept at least ``BUSY_CORES`` busy (the
    rows' median): one sentence saying so and why the figures stand; else ""."""
    if rows is None or rows.empty:
        return ""
    timed = timed_ok(rows)
    if timed.empty:
        return ""
    used, cores = _median(timed, "busy_cores"), _median(timed, "cores")
    spoiled = (
        int(pd.to_numeric(timed["contended_rounds"], errors="coerce").fillna(0).sum())
        if "contended_rounds" in timed.columns
        else 0
    )
    if math.isnan(used) or used < BUSY_CORES:  # a stray spoiled repetition is not a busy machine
        return ""
    of = "" if math.isnan(cores) else f" of {cores:.0f}"
    how = (
        f": other processes used {used:.1f}{of} cores during these rounds"
        if not math.isnan(used)
        else ""
    )
    retimed = (
        f"the {spoiled} repetition{'s' if spoiled > 1 else ''} it spoiled "
        f"{'were' if spoiled > 1 else 'was'} re-timed in clean rounds"
        if spoiled
        else "no repetition waited for a CPU"
    )
    wait = _median(timed, "cpu_wait")
    clocks = set(timed["timed_by"].astype(str)) if "timed_by" in timed.columns else set()
    if "cpu" in clocks and not math.isnan(wait) and wait > SPOILED_WAIT:
        # the CPU clock: the waits were there, and they are not in the figures
        retimed = (
            f"its threads waited for a CPU {wait:.0%} of the time, which the figures leave out "
            "(each is the timed thread's CPU time; the wall time is in wall_ms_median)"
            + (f", and {spoiled} repetitions spoiled otherwise were re-timed" if spoiled else "")
        )
    return (
        f"the machine was busy{how}; {retimed} and no point stayed contended, so the figures stand."
    )
