"""Render a run's or sweep's rows into one self-contained HTML file (figures inlined as PNG).

``python -m harness.report <run or sweep dir>`` re-renders from the files alone: results.csv
(or the job rows, gathered again) and Hydra's record of the overrides.
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
import io
import os
import sys
from pathlib import Path

import jinja2
import matplotlib

matplotlib.use("Agg")  # no display; must precede pyplot
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402
import yaml  # noqa: E402

from harness.progress import case  # noqa: E402
from harness.results import RESULTS_FILE, gather  # noqa: E402

TEMPLATES = Path(__file__).parent / "templates"
TABLE_COLUMNS = [
    "status", "label", "compile", "mode", "batch", "seq_len", "kv_seq_len", "embed_dim", "num_heads",
    "dtype", "device", "mask", "latency_ms_median", "latency_ms_iqr", "n_samples", "noise",
    "tflops", "pct_of_peak", "pct_of_datasheet_peak", "peak_mem_mb", "scores_materialized",
    "sdpa_kernel", "compile_s", "check_passed", "worst_tensor", "max_abs_err", "tolerance",
    "err_ratio", "error",
]
STATUS_ORDER = ["mismatch", "error", "oom", "unsupported", "invalid", "ok"]  # failures first


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _categorical(series: pd.Series) -> pd.Series:
    # pandas 3 string columns break seaborn 0.13.2's hue_order; categoricals work in both.
    return pd.Categorical(series.astype(str), categories=sorted(series.astype(str).unique()))


def latency_figure(df: pd.DataFrame) -> str | None:
    """Latency vs seq_len, one line per variant label, one panel per dtype (and mask)."""
    timed = df[df["latency_ms_median"].notna()].copy()
    if timed.empty:
        return None
    timed["variant"] = _categorical(timed["label"] + timed["compile"].map(
        lambda c: "" if c in ("off", None) or pd.isna(c) else f" +compile={c}"))
    timed["dtype"] = _categorical(timed["dtype"])
    timed["mask"] = _categorical(timed["mask"])
    g = sns.relplot(
        data=timed, x="seq_len", y="latency_ms_median", hue="variant", col="dtype",
        row="mask" if timed["mask"].nunique() > 1 else None,
        kind="line", marker="o", errorbar=None, height=3.2, aspect=1.3,
        facet_kws={"sharey": False},
    )
    g.set(xscale="log", yscale="log")
    g.set_axis_labels("seq_len (tokens)", "median latency (ms)")
    return _png(g.figure)


def read_overrides(root: Path) -> list[str]:
    """The overrides the run or sweep was started with, from Hydra's own record."""
    for path, keys in ((root / "multirun.yaml", ("hydra", "overrides", "task")),
                       (root / ".hydra" / "overrides.yaml", ())):
        if path.exists():
            node = yaml.safe_load(path.read_text())
            for k in keys:
                node = (node or {}).get(k)
            return list(node or [])
    return []


def profile_rows(df: pd.DataFrame, root: Path, link_from: Path) -> list[dict]:
    """Per-point profile summaries, with a link to each point's trace dir from ``link_from``."""
    if "trace_dir" not in df.columns:
        return []
    rows = []
    for r in df[df["trace_dir"].notna()].to_dict("records"):
        rows.append({
            "label": r.get("label"), "case": case(r),
            "ops_per_call": r.get("ops_per_call"), "copies_per_call": r.get("copies_per_call"),
            "kernels_per_call": r.get("kernels_per_call"), "top_ops": r.get("top_ops"),
            "link": os.path.relpath(root / r["trace_dir"], start=link_from),
            "trace_dir": r["trace_dir"],
        })
    return rows


def render(df: pd.DataFrame, title: str, overrides: list[str], root: Path,
           links_from: list[Path]) -> list[str]:
    """The report's HTML once per place it will be opened from (trace links are relative)."""
    df = df.copy()
    order = {s: i for i, s in enumerate(STATUS_ORDER)}
    df["_order"] = df["status"].map(lambda s: order.get(s, -1))
    table = df.sort_values(["_order"], kind="stable")[[c for c in TABLE_COLUMNS if c in df.columns]]
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), autoescape=True)
    context = dict(
        title=title,
        generated=dt.datetime.now().isoformat(timespec="seconds"),
        overrides=overrides,
        counts=df["status"].value_counts().to_dict() if len(df) else {},
        n_rows=len(df),
        torch_version=", ".join(sorted(df["torch_version"].dropna().astype(str).unique()))
        if "torch_version" in df else "",
        devices=", ".join(sorted(df["device"].dropna().astype(str).unique())) if "device" in df else "",
        latency_png=latency_figure(df) if len(df) else None,
        columns=list(table.columns),
        rows=table.to_dict("records"),
        tensorboard_cmd=f"python -m harness.tensorboard {root}",
    )
    template = env.get_template("report.html.j2")
    return [template.render(**context, profiles=profile_rows(df, root, where)) for where in links_from]


def report_name(root: Path) -> str:
    """results/sweeps/2026-11-21_10-00-00 -> sweeps-2026-11-21_10-00-00.html"""
    return f"{root.parent.name}-{root.name}.html" if root.parent.name else f"{root.name}.html"


def render_dir(root: str | Path, report_dir: str | Path = "reports") -> Path:
    """Render ``root``'s rows to ``<root>/report.html`` and a copy under ``report_dir``."""
    root = Path(root).resolve()
    csv = root / RESULTS_FILE
    df = pd.read_csv(csv, keep_default_na=False, na_values=[""]) if csv.exists() else gather(root)
    out = Path(report_dir).resolve() / report_name(root)
    out.parent.mkdir(parents=True, exist_ok=True)
    root.mkdir(parents=True, exist_ok=True)
    here, there = render(df, title=f"mha-bench: {root.name}", overrides=read_overrides(root), root=root,
                         links_from=[root, out.parent])
    (root / "report.html").write_text(here)
    out.write_text(there)
    return Path(os.path.relpath(out)) if not Path(report_dir).is_absolute() else out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.report", description=__doc__.splitlines()[0])
    parser.add_argument("dir", help="a run or sweep dir (holds results.csv or job dirs with result.csv)")
    parser.add_argument("--report-dir", default="reports", help="where the copy goes (default: reports)")
    args = parser.parse_args(argv)
    root = Path(args.dir)
    if not root.is_dir():
        print(f"error: {args.dir!r} is not a directory", file=sys.stderr)
        return 2
    print(f"report: {render_dir(root, args.report_dir)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
