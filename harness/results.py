"""The results schema, one row per point, and the gatherer.

Each job writes its own ``result.csv`` (one row) into its own output dir, atomically; the
gatherer reads whatever rows exist under a run or sweep dir and writes ``results.csv`` there.
Jobs never share a file, so any Hydra launcher (local, joblib, submitit) works the same.
"""

from __future__ import annotations

import csv
import io
import os
import re
import tempfile
from pathlib import Path

import pandas as pd

ROW_FILE = "result.csv"
RESULTS_FILE = "results.csv"

# Public schema: README "Results" documents every column with its unit. Order is the CSV order.
COLUMNS = [
    "variant",  # config group choice, e.g. fused
    "variant_options",  # the variant's own options, "attention=sdpa merge=view"
    "label",  # variant plus option values, e.g. fused/sdpa/view: what plots and tables group by
    "compile",  # off | default | reduce-overhead | max-autotune
    "mode",  # fwd | fwd_bwd
    "batch", "seq_len", "kv_seq_len", "embed_dim", "num_heads", "head_dim",
    "dtype", "device", "mask", "mask_format", "need_weights", "average_attn_weights",
    "cross", "bias", "seed", "sdpa_backend", "num_threads",
    "status",  # ok | mismatch | oom | unsupported | invalid | error
    "error",  # message when status is not ok
    # timing in rounds (README "How a point is checked and timed"): intervals are 95%
    "latency_ms_median", "latency_ms_ci_low", "latency_ms_ci_high",
    "speedup", "speedup_ci_low", "speedup_ci_high",
    "latency_ms_iqr", "latency_ms_p10", "latency_ms_p90",
    "n_samples", "calls_per_round", "rounds_span_s", "noise", "noise_target_met", "timing_s",
    # throughput and roofline
    "flops", "tflops", "peak_tflops", "pct_of_peak", "peak_tflops_datasheet", "pct_of_datasheet_peak",
    # what ran, memory, compile
    "sdpa_kernel", "peak_mem_mb", "scores_materialized", "compile_s", "compiled_graphs", "recompiles",
    # profiling pass (profile=true)
    "trace_dir", "ops_per_call", "copies_per_call", "kernels_per_call", "top_ops", "profile_error",
    # the check
    "check_passed", "max_abs_err", "max_rel_err", "ref_err", "err_ratio", "tolerance",
    "worst_tensor", "worst_index", "tensors_checked",
    # environment (env.json at the run/sweep root has the rest)
    "device_name", "torch_version", "cuda_version", "git_commit", "hostname",
    "overrides",  # the point's Hydra overrides, as typed
    "config_hash",  # fingerprint of the point's full configuration (resume matches on it)
]
STATUSES = ("ok", "mismatch", "oom", "unsupported", "invalid", "error")

# A row's configuration is its way of writing attention (WAY_KEYS) at a shape (SHAPE_KEYS): the
# ranking compares ways within a shape, and no figure or table may merge rows that differ in any
# of these keys (README "Reports").
WAY_KEYS = ["variant", "variant_options", "compile", "sdpa_backend"]
SHAPE_KEYS = ["batch", "seq_len", "kv_seq_len", "embed_dim", "num_heads", "dtype", "device", "mask",
              "mask_format", "mode", "cross", "bias", "need_weights", "average_attn_weights", "seed",
              "num_threads"]
CONFIG_KEYS = WAY_KEYS + SHAPE_KEYS


def way(row) -> str:
    """The way of writing attention a row measured: variant/options, compile mode, SDPA pin."""
    text = str(row.get("label") or row.get("variant"))
    if row.get("compile") not in (None, "off") and row.get("compile") == row.get("compile"):
        text += f" +compile={row['compile']}"
    if row.get("sdpa_backend") not in (None, "auto") and row.get("sdpa_backend") == row.get("sdpa_backend"):
        text += f" sdpa={row['sdpa_backend']}"
    return text


def atomic_write_text(path: Path, text: str) -> None:
    """Write to a temporary file in the same dir, then rename: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", newline="") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_row(job_dir: str | os.PathLike, row: dict) -> Path:
    """Write one point's row to ``<job_dir>/result.csv``; unknown keys go after the schema."""
    columns = COLUMNS + [k for k in row if k not in COLUMNS]
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


def find_rows(root: str | os.PathLike) -> list[Path]:
    return sorted(Path(root).rglob(ROW_FILE), key=_natural_key)


def gather(root: str | os.PathLike) -> pd.DataFrame:
    """All rows under ``root`` (a run dir or a sweep dir), in job order, schema columns first."""
    frames = [pd.read_csv(p, keep_default_na=False, na_values=[""]) for p in find_rows(root)]
    if not frames:
        return pd.DataFrame(columns=COLUMNS)
    df = pd.concat(frames, ignore_index=True)
    return df[COLUMNS + [c for c in df.columns if c not in COLUMNS]]


def write_results(root: str | os.PathLike, transform=None) -> tuple[Path, pd.DataFrame]:
    """Gather ``root``'s rows into ``<root>/results.csv`` (atomically), through ``transform``
    (rows -> rows) when given; return its path and rows."""
    df = gather(root)
    if transform is not None:
        df = transform(df)
    path = Path(root) / RESULTS_FILE
    atomic_write_text(path, df.to_csv(index=False))
    return path, df
