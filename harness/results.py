"""The results schema, one row per point, and the gatherer.

Each job writes its own ``result.csv`` (one row) into its own output dir, atomically; the
gatherer reads whatever rows exist under a run or sweep dir and writes ``results.csv`` there.
Jobs never share a file, so any Hydra launcher (local, joblib, submitit) works the same.
"""

from __future__ import annotations

import csv
import io
import json
from collections import Counter
import math
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from harness import features
from harness.config import KV_CACHES, keys_with
from harness.files import atomic_write_text
from harness.schema import ROW, computed

if TYPE_CHECKING:  # pandas is imported where a table is read: a point's worker writes no table
    import pandas as pd

ROW_FILE = "result.csv"
RESULTS_FILE = "results.csv"
# A failed row's full traceback travels with it under this key, which is not a column: the job
# writes it beside its row (TRACEBACK_FILE, ``write_row``) and the sweep's log keeps it.
TRACEBACK = "traceback"
TRACEBACK_FILE = "traceback.txt"  # a failed point's traceback, beside its row (write_row)
ERRORS_FILE = "errors.log"  # every failed point's traceback, beside results.csv (write_errors)
ENV_FILE = "env.json"  # the machine and the sweep (harness/envinfo.py), beside results.csv
PEAK_FILE = "peak.json"  # the measured peaks (harness/measure/roofline.py)


def number(value) -> float:
    """A cell as a float: NaN where it is empty, missing or not a number (one rule for every
    CSV reader: effects, ranking, compare)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


# The CSV's columns in order, and those the timing rounds fill in (a resumed point keeps its row's
# other columns, its check, and gets these anew): both read from the one row schema.
COLUMNS = [c.name for c in ROW]
ROUNDS_COLUMNS = tuple(c.name for c in ROW if c.rounds)

# A row's configuration is its way of writing attention (WAY_KEYS) at a shape (SHAPE_KEYS): the
# ranking compares ways within a shape, and no figure or table may merge rows that differ in any
# of these keys (docs/guide.md, "Reports"). Both come from the keys' roles (config.ROLES): the
# variant's options are part of its way (``variant_options``, a column of its own); the machine's
# keys (threads) part of a row's shape in a run.
WAY_KEYS = ["variant", "variant_options", *(k for k in keys_with("way") if k != "variant")]
SHAPE_KEYS = list(keys_with("shape", "model", "machine"))
CONFIG_KEYS = WAY_KEYS + SHAPE_KEYS


def distinct(df: pd.DataFrame) -> pd.DataFrame:
    """One row per configuration. A row that ran with a variant's fixed value instead of the asked
    one (``fixed``) can repeat a row that asked for that value (a sweep over bias=true,false of a
    variant fixed to bias=false): figures, the ranking and compare keep the row run as asked."""
    if df.empty or "fixed" not in df.columns:
        return df
    keys = [k for k in CONFIG_KEYS if k in df.columns]
    moved = df["fixed"].map(lambda v: isinstance(v, str) and v != "")  # NaN when empty in the CSV
    order = moved.sort_values(kind="stable").index  # rows run as asked first
    repeated = df.loc[order, keys].astype(str).duplicated(keep="first")
    return df.loc[~repeated.reindex(df.index)]


def timed_ok(df: pd.DataFrame) -> pd.DataFrame:
    """The correct timed rows, one per configuration, each timed as the rest of its shape
    (``other_method``): what rankings, effects and figures are made of (empty when the rows have
    no timing columns)."""
    timed = timed_rows(df)
    return timed[~other_method(timed)]


def timed_rows(df: pd.DataFrame) -> pd.DataFrame:
    """The correct timed rows, one per configuration, however each was timed (``timed_ok``
    keeps those timed as the rest of their shape): eager call times compare across them."""
    import pandas as pd

    if df.empty or "latency_ms_median" not in df.columns:
        return df.iloc[0:0]
    df = distinct(df)
    return df[
        (df["status"] == "ok") & pd.to_numeric(df["latency_ms_median"], errors="coerce").notna()
    ]


def shape_method(timed: pd.DataFrame) -> pd.Series:
    """Per row, how most rows of its shape were timed (``timed_by``; on a tie the CUDA graph's
    replay): a CUDA call replayed from a graph is device time, one timed between CUDA events
    (after a failed capture) is the eager call time, and the two are not compared."""
    import pandas as pd

    method = _methods(timed)
    keys = [timed[k].astype(str) for k in SHAPE_KEYS if k in timed.columns]

    def main(methods: pd.Series) -> str:
        counts = methods.value_counts()
        best = counts[counts == counts.max()].index
        return "graph" if "graph" in best else sorted(best)[0]

    if not keys:
        return pd.Series(main(method), index=timed.index)
    return method.groupby(keys, sort=False, dropna=False).transform(main)


def other_method(timed: pd.DataFrame) -> pd.Series:
    """Bool per row: timed otherwise than most of its shape (``shape_method``), so that no
    ranking, effect or finding compares a device time with an eager call time."""
    import pandas as pd

    if timed.empty or "timed_by" not in timed.columns:
        return pd.Series(False, index=timed.index)
    return _methods(timed) != shape_method(timed)


def _methods(timed: pd.DataFrame) -> pd.Series:
    """Each row's ``timed_by`` as text ("" where empty: a row from before the column)."""
    return timed["timed_by"].map(lambda v: "" if v is None or v != v else str(v))


HOW_TIMED = {"graph": "replayed from a CUDA graph", "events": "timed between CUDA events"}


def left_out_by_method(df: pd.DataFrame) -> str:
    """The sentence for the rows ``timed_ok`` leaves out as timed otherwise than their shape
    (empty when none): how many, at how many shapes, and why."""
    timed = timed_rows(df)
    out = other_method(timed)
    if not out.any():
        return ""
    rows, mains = timed[out], shape_method(timed)[out]
    shapes = len(rows[[k for k in SHAPE_KEYS if k in rows.columns]].astype(str).drop_duplicates())

    def said(methods) -> str:
        return " or ".join(HOW_TIMED.get(m, f"timed by {m}") for m in sorted(set(methods)))

    n = len(rows)
    return (
        f"{n} timed {'way is' if n == 1 else 'ways are'} left out of the ranking, the effects "
        f"and the findings at {shapes} shape{'s' if shapes > 1 else ''}: "
        f"{said(_methods(rows))} where the rest of the shape was "
        f"{said(mains)}, and a device time is not an eager call time (`graph_error` says why a "
        "call was not captured)"
    )


def timing_left(df: pd.DataFrame) -> str:
    """What a stopped sweep left untimed, in a sentence (empty when nothing): its points whose
    timing is pending (checked, no rounds yet) or partial (fewer rounds than asked)."""
    if df.empty or "timing_state" not in df.columns:
        return ""
    pending = int((df["timing_state"] == "pending").sum())
    partial = int((df["timing_state"] == "partial").sum())
    parts = [
        f"{pending} points checked but not yet timed" if pending else "",
        f"{partial} timed in fewer rounds than asked (wider intervals)" if partial else "",
    ]
    if not pending and not partial:
        return ""
    return (
        "stopped before its timing ended: "
        + ", ".join(p for p in parts if p)
        + " (column timing_state); run the same sweep again with resume=true to finish them"
    )


def factors(row: dict) -> dict[str, str]:
    """A row's way as its factors: structure, the variant's options, compile, SDPA pin, KV cache
    (decode); and the model's keys (harness/report/effects.py, MODEL_KEYS): K/V heads, mask
    (``sliding:W`` with its window)."""
    out = {"structure": str(row.get("variant"))}
    for part in str(text_or(row.get("variant_options"), "")).split():
        key, _, value = part.partition("=")
        if key:
            out[key] = value
    out["compile"] = str(text_or(row.get("compile"), "off"))
    out["sdpa_backend"] = str(text_or(row.get("sdpa_backend"), "auto"))
    cache = str(text_or(row.get("kv_cache"), ""))
    if cache or cache_text(row):  # a feature's style with its size: one factor against static
        out["kv_cache"] = cache_text(row)
    heads = number(row.get("num_kv_heads"))
    heads = heads if not math.isnan(heads) else number(row.get("num_heads"))  # older rows
    if not math.isnan(heads):
        out["num_kv_heads"] = str(int(heads))
    mask, window = text_or(row.get("mask"), ""), number(row.get("window"))
    if mask:
        out["mask"] = f"sliding:{int(window)}" if mask == "sliding" and window == window else mask
    return out


def cache_text(row) -> str:
    """How a decode row's way holds its cache: static, concat, none, or a model feature's style
    as it says it, with its size (harness/features/)."""
    return features.cache(row, str(text_or(row.get("kv_cache"), "")))


def text_or(value, default: str):
    """``value``, or ``default`` where it is missing (None, or NaN: pandas's empty cell)."""
    return default if value is None or (isinstance(value, float) and math.isnan(value)) else value


def way(row) -> str:
    """The way of writing attention a row measured: variant/options, compile mode, SDPA pin,
    KV cache."""
    text = str(row.get("label") or row.get("variant"))
    if row.get("compile") not in (None, "off") and row.get("compile") == row.get("compile"):
        text += f" +compile={row['compile']}"
    if row.get("sdpa_backend") not in (None, "auto") and row.get("sdpa_backend") == row.get(
        "sdpa_backend"
    ):
        text += f" sdpa={row['sdpa_backend']}"
    if row.get("kv_cache") in KV_CACHES:  # decode: how the cache is held
        text += f" cache={cache_text(row)}"
    elif cache_text(row):  # a feature's size on a row that names no cache
        text += f" {cache_text(row)}"
    return text


# Exit codes (docs/guide.md, "When something goes wrong"): 0 done; 1 a check failed, nothing was
# checked (check_only) or a single run's point is not ok; 2 refused before any point ran (bad
# value, unknown key, output dir not writable or in use); 3 results or report not written, or
# rows lost; 130 interrupted (SIGINT, Ctrl-C); 143 terminated (SIGTERM). Stopped, a sweep still
# gathers what finished and writes its report.
EXIT_FAILED, EXIT_REFUSED, EXIT_WRITE = 1, 2, 3
EXIT_INTERRUPTED, EXIT_TERMINATED = 130, 143


def write_row(job_dir: str | os.PathLike, row: dict) -> Path:
    """Write one point's row to ``<job_dir>/result.csv``. Columns the schema computes from the
    others (``Column.compute``) are filled in here. A key that harness/schema.py's ROW does not
    define is refused (ValueError naming it): a typo must not become a stray column. A failed
    row's traceback (``TRACEBACK``, not a column) goes to ``<job_dir>/traceback.txt``;
    a row without one removes an earlier run's."""
    row = computed(row)
    trace = row.pop(TRACEBACK, None)
    if trace:
        atomic_write_text(Path(job_dir) / TRACEBACK_FILE, trace + "\n")
    else:
        (Path(job_dir) / TRACEBACK_FILE).unlink(missing_ok=True)
    stray = [k for k in row if k not in COLUMNS]
    if stray:
        raise ValueError(
            f"result row: {', '.join(map(repr, stray))} not a column of harness/schema.py's ROW"
        )
    columns = COLUMNS
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, extrasaction="raise")
    writer.writeheader()
    writer.writerow({k: row.get(k, "") for k in columns})
    path = Path(job_dir) / ROW_FILE
    atomic_write_text(path, buf.getvalue())
    return path


def _natural_key(path: Path):
    # Hydra numbers job dirs 0, 1, ..., 10: sort them as numbers, not strings.
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", str(path))]


# The jobs of the sweep (or run) being run in this process: job dir -> config hash of the row it
# wrote or kept (resume). The gatherer takes exactly these rows (JOBS_FILE), so a smaller or
# changed sweep into an old dir reports its own points, not what earlier sweeps left there.
JOBS_FILE = "jobs.json"
JOBS: dict[str, str] = {}


def record_job(job_dir: str | os.PathLike, fingerprint: str) -> None:
    JOBS[str(Path(job_dir).resolve())] = fingerprint


def write_jobs(root: str | os.PathLike, jobs: dict[str, str]) -> None:
    """``<root>/jobs.json``: the sweep's job dirs (relative to root) and their rows' config
    hashes."""
    root = Path(root).resolve()
    listed = [
        {"dir": os.path.relpath(d, root), "config_hash": h}
        for d, h in sorted(jobs.items(), key=lambda kv: _natural_key(Path(kv[0])))
    ]
    atomic_write_text(root / JOBS_FILE, json.dumps({"jobs": listed}, indent=1) + "\n")


def find_rows(root: str | os.PathLike) -> list[Path]:
    return sorted(Path(root).rglob(ROW_FILE), key=_natural_key)


# Hex digests read as text: pandas read "83924815253808e9" as 8.39e22, "0123..." as an int.
TEXT_COLUMNS = {"config_hash": str, "variant_source_hash": str, "git_commit": str}


class DamagedFile(ValueError):
    """A file a command reads is not what it should be (empty, binary, truncated), named in one
    line: the commands leave with it as a refusal (``harness.leaving.leave``: exit 2)."""


def read_csv(path) -> pd.DataFrame:
    """A results CSV as written: empty cells are NaN, hashes stay text. ``DamagedFile`` naming
    the file when it cannot be read as a table (empty, binary, cut mid-quote)."""
    import pandas as pd

    try:
        return pd.read_csv(path, keep_default_na=False, na_values=[""], dtype=TEXT_COLUMNS)
    except (UnicodeDecodeError, pd.errors.ParserError, pd.errors.EmptyDataError) as e:
        why = (str(e).strip().splitlines() or [""])[0][:120]
        raise DamagedFile(f"{path} cannot be read as a table ({type(e).__name__}: {why})") from e


def read_row(path: Path) -> pd.DataFrame:
    """One job's row; ``ValueError`` saying what is wrong when the file is damaged."""
    try:
        df = read_csv(path)
    except (DamagedFile, OSError) as e:
        raise ValueError(f"{path}: unreadable ({type(e.__cause__ or e).__name__})") from e
    if len(df) != 1 or not {"status", "config_hash"} <= set(df.columns):
        raise ValueError(
            f"{path}: not a result row ({len(df)} rows, columns {list(df.columns)[:3]}...)"
        )
    return df


def _rows(root: Path, problems: list[str]) -> list[tuple[Path, pd.DataFrame]]:
    """(row file, row) of each job of ``root`` in job order (``gather``)."""
    listing = root / JOBS_FILE
    found, jobs = [], None
    if listing.exists():
        try:
            jobs = [(j["dir"], j["config_hash"]) for j in json.loads(listing.read_text())["jobs"]]
        except (ValueError, KeyError, TypeError) as e:
            problems.append(f"{listing} is damaged ({type(e).__name__}): every row under it taken")
    if jobs is not None:
        for job_dir, config_hash in jobs:
            path = root / job_dir / ROW_FILE
            if not path.exists():
                problems.append(f"{path}: missing")
                continue
            try:
                df = read_row(path)
            except ValueError as e:
                problems.append(str(e))
                continue
            if str(df["config_hash"].iloc[0]) != config_hash:
                problems.append(f"{path}: written by another sweep (config hash differs)")
                continue
            found.append((path, df))
    else:
        for path in find_rows(root):
            try:
                found.append((path, read_row(path)))
            except ValueError as e:
                problems.append(str(e))
    return found


def gather(root: str | os.PathLike, problems: list[str] | None = None) -> pd.DataFrame:
    """The rows of ``root`` (a run dir or a sweep dir) in job order, schema columns first: the
    jobs listed in its jobs.json when it has one (rows whose config hash differs are left out),
    else every row under it. A damaged or missing row is left out and described in ``problems``."""
    import pandas as pd

    problems = [] if problems is None else problems
    frames = [df for _, df in _rows(Path(root), problems)]
    if not frames:
        return pd.DataFrame(columns=COLUMNS)
    df = pd.concat(frames, ignore_index=True)
    for column in COLUMNS:
        if column not in df.columns:  # rows written before a column existed
            df[column] = None
    return df[COLUMNS + [c for c in df.columns if c not in COLUMNS]]


def read_results(
    root: str | os.PathLike, problems: list[str] | None = None, notes: list[str] | None = None
) -> pd.DataFrame:
    """``root``'s rows: its results.csv, or, where that disagrees with its jobs.json (rows cut
    off, repeated, another sweep's) or cannot be read, gathered again from the jobs' own rows,
    ``notes`` saying why (it rendered 8 of 16 points with exit 0); ``problems``: rows left out."""
    problems = [] if problems is None else problems
    notes = problems if notes is None else notes
    csv, listing = Path(root) / RESULTS_FILE, Path(root) / JOBS_FILE
    if not csv.exists():
        return gather(root, problems)
    try:
        df = read_csv(csv)
    except DamagedFile as e:
        if not listing.exists():
            raise
        notes.append(f"{e}; read from the jobs' rows instead")
        return gather(root, problems)
    if not listing.exists():
        return df
    try:
        listed = Counter(str(j["config_hash"]) for j in json.loads(listing.read_text())["jobs"])
    except (ValueError, KeyError, TypeError):  # held against every row under it (gather says)
        listed = Counter(gather(root, [])["config_hash"].astype(str))
    held = Counter(df["config_hash"].astype(str)) if "config_hash" in df.columns else Counter()
    if held == listed:
        return df
    missing, extra = sum((listed - held).values()), sum((held - listed).values())
    notes.append(
        f"{csv} holds {len(df)} row(s) where {listing.name} lists {sum(listed.values())} points "
        f"({missing} missing, {extra} not listed or repeated: cut short or edited); read from "
        "the jobs' rows instead"
    )
    return gather(root, problems)


def errors_text(root: str | os.PathLike) -> str:
    """``errors.log``'s text: one section per point of ``root`` that is not ``ok`` (or has a
    traceback), naming its job dir and its overrides, then its status, its whole error (the
    console groups them by way, one line each: harness/report/verdicts.py) and its traceback
    (a mismatch, an unsupported point or a crashed or hung worker has none: the row's error is
    what there is). Empty when every point is ok."""
    root = Path(root)
    sections = []
    for path, df in _rows(root, []):
        row = df.iloc[0].to_dict()
        trace_file = path.parent / TRACEBACK_FILE
        trace = trace_file.read_text().rstrip() if trace_file.exists() else ""
        if not trace and row.get("status") == "ok":
            continue
        job = os.path.relpath(path.parent, root)
        what = _text(row.get("overrides")) or _text(row.get("label"))
        head = f"== job {job} ({what}): {row.get('status')} =="
        body = trace or NO_TRACEBACK.get(str(row.get("status")), "no Python traceback")
        sections.append(f"{head}\n{_text(row.get('error'))}\n\n{body}\n")
    return "\n".join(sections)


NO_TRACEBACK = {  # why a section has no traceback
    "crashed": "no Python traceback (the worker process ended or was killed)",
    "timeout": "no Python traceback (the worker process ended or was killed)",
    "mismatch": "(a wrong result, not an exception: no traceback)",
}


def _text(value) -> str:
    return "" if value is None or (isinstance(value, float) and math.isnan(value)) else str(value)


def write_errors(root: str | os.PathLike) -> Path | None:
    """``<root>/errors.log`` (atomically) from ``errors_text``; an earlier one is removed when no
    point failed. Returns its path, or None."""
    path = Path(root) / ERRORS_FILE
    text = errors_text(root)
    if not text:
        path.unlink(missing_ok=True)
        return None
    atomic_write_text(path, text)
    return path


def write_results(
    root: str | os.PathLike, transform=None, problems: list[str] | None = None
) -> tuple[Path, pd.DataFrame]:
    """Gather ``root``'s rows into ``<root>/results.csv`` (atomically), through ``transform``
    (rows -> rows) when given, and the failed points' tracebacks into ``<root>/errors.log``
    (``write_errors``); return its path and rows. ``WriteError`` when it cannot be written."""
    df = gather(root, problems)
    if transform is not None:
        df = transform(df)
    path = Path(root) / RESULTS_FILE
    atomic_write_text(path, df.to_csv(index=False))
    write_errors(root)
    return path, df
