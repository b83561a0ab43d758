"""Render a run's or sweep's rows into one self-contained HTML file (figures inlined as PNG).

``python -m harness.report <run or sweep dir>`` re-renders from the files alone: results.csv
(or the job rows, gathered again), env.json and Hydra's record of the sweep. The report opens
from disk with no network. Missing columns or degenerate sweeps (one point, one variant,
everything failed) render what there is: a figure that cannot be drawn says why instead, and
one that fails is named with its error at the top of the page (``strict``: it raises). The rows
are analyzed once (analysis.py); the figures are catalogue.py's list.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
from pathlib import Path

import jinja2
import pandas as pd
import yaml

from markupsafe import Markup

from harness.report import analysis, effects, tensorboard, verdicts
from harness.report.analysis import Analysis
from harness.report.analysis import prepare  # noqa: F401 - the rows as the report reads them
from harness.report.compiled import compile_table
from harness.report.tables import (  # noqa: F401 - short_label: the tests read it here
    best_per_shape,
    correctness_rows,
    legend,
    paired_rows,
    problem_rows,
    short_label,
)
from harness import schema
from harness.envinfo import threads_said
from harness.schema import ROW
from harness.progress import headline
from harness.results import (
    ENV_FILE,
    PEAK_FILE,
    RESULTS_FILE,
    ROW_FILE,
    find_rows,
    timed_ok,  # noqa: F401 - the rows the figures are drawn from
    timing_left,
)
from harness.files import WriteError, atomic_write_text

TEMPLATES = Path(__file__).parent / "templates"
# The report's table of every row: status and the way first, the schema's table columns, the
# error last (it is the longest).
TABLE_COLUMNS = [
    "status",
    "way",
    *(c.name for c in ROW if c.table and c.name not in ("status", "error")),
    "error",
]
STATUS_ORDER = [
    "mismatch",
    "error",
    "crashed",
    "timeout",
    "oom",
    "unsupported",
    "invalid",
    "ok",
]  # failures first


def launch_bound_note(df: pd.DataFrame) -> str:
    """A sentence on the CUDA points whose eager call a Python caller waits for much longer than
    the GPU needs (``launch_bound``: eager call time at least schema.LAUNCH_BOUND x device time),
    or empty: there an eager call runs at Python's pace, and the device time that ranks them is
    what a CUDA graph would give. Rows without eager times (written before them) were flagged by
    their own older rule, and say so."""
    if "launch_bound" not in df.columns or df.empty:
        return ""
    bound = df[df["launch_bound"].map(lambda v: v is True or str(v).lower() == "true")]
    if bound.empty:
        return ""
    judged = int(df["launch_bound"].map(lambda v: v is not None and v == v and v != "").sum())
    head = f"{len(bound)} of {judged} timed CUDA points are launch-bound"
    if "eager_ms_median" not in df.columns:
        return (
            f"{head} by the older rule these rows were written under (time to enqueue a call "
            "against its latency; they carry no eager call time): their latency is mostly "
            "Python's pace, not the GPU's"
        )
    return (
        f"{head} (eager call time at least {schema.LAUNCH_BOUND:g}x device time): an eager call "
        "waits for Python's kernel launches while the GPU idles between kernels. Their latency, "
        "which ranks them, is device time (the call replayed from a CUDA graph); "
        "eager_ms_median is what an eager caller waits. A CUDA graph, "
        "compile=reduce-overhead or a bigger batch brings an eager caller to the device time"
    )


def decoration(path: Path, parse, default):
    """A file the report only decorates with (env.json, peak.json, multirun.yaml), parsed; where
    it is missing, ``default``; where it is damaged, ``default`` and a warning naming it: the
    report is drawn without it rather than not at all."""
    if not path.exists():
        return default
    try:
        value = parse(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, yaml.YAMLError) as e:
        print(f"warning: {path}: damaged ({type(e).__name__}); the report leaves it out",
              file=sys.stderr)  # fmt: skip
        return default
    return value if isinstance(value, type(default)) else default


def read_sweep(root: Path, cuda: bool = False) -> tuple[list[str], dict]:
    """The overrides the run or sweep was started with, and the sweeper's params (its
    cuda_params when the points ran on CUDA and it has them), from Hydra's record. A list of
    sweeps (a union, ``sweep=llm``) is given one line per sweep."""
    multirun = root / "multirun.yaml"
    if multirun.exists():
        cfg = decoration(multirun, yaml.safe_load, {})
        hydra = cfg.get("hydra") or {}
        sweeper = hydra.get("sweeper") or {}
        params = (cuda and sweeper.get("cuda_params")) or sweeper.get("params") or {}
        if isinstance(params, list):
            params = {
                f"sweep {i + 1}": " ".join(f"{k}={v}" for k, v in (p or {}).items())
                for i, p in enumerate(params)
            }
        return list((hydra.get("overrides") or {}).get("task") or []), dict(params)
    overrides = root / ".hydra" / "overrides.yaml"
    if overrides.exists():
        return list(decoration(overrides, yaml.safe_load, [])), {}
    return [], {}


def throughput_note(peaks: dict) -> str:
    """The throughput section's note: the FLOP model, what % of peak means, the peaks."""
    note = Markup(
        "FLOP model in docs/methodology.md. % of measured peak: the best of dense matmuls of "
        "several sizes and operand layouts timed on this device and dtype "
        "(<code>peak.json</code>), re-measured when a point beat it; a point that still beats it "
        "becomes the peak, so no point exceeds 100%."
    )
    if peaks:
        listed = Markup("; ").join(
            Markup("<code>{}</code> {} TFLOP/s ({})").format(
                k, num(p.get("tflops"), "%.3g"), p.get("source") or "torch.mm"
            )
            for k, p in peaks.items()
        )
        note += Markup(" Peaks: {}.").format(listed)
    return note


def _attempt(name: str, make, strict: bool) -> dict:
    """``{"value": make()}``, or ``{"error": ...}`` when it raises (``strict``: it raises
    catalogue.FigureFailed)."""
    try:
        return {"value": make()}
    except Exception as e:  # noqa: BLE001 - shown in the page
        if strict:
            from harness.report.catalogue import FigureFailed

            raise FigureFailed(f"{name!r} failed: {type(e).__name__}: {e}") from e
        return {"value": None, "error": f"{type(e).__name__}: {e}"}


def drawn_figures(a: Analysis, peaks: dict, strict: bool = False) -> dict:
    """The figures (catalogue.draw) laid out in sections, the entries that do not apply, what
    failed, the forest plot of the effects and the compile-time table. Nothing timed (a
    check_only run): no figure, and matplotlib is not even imported (a one-point check's time)."""
    if a.timed.empty:
        nothing = {"value": None}
        return dict(sections=[], skipped=[], failed=[], forest=nothing, compile=nothing)
    from harness.report import catalogue, charts  # matplotlib (seaborn for the heatmap): a second

    drawn = catalogue.draw(a.timed, strict=strict)
    forest = _attempt("forest plot", lambda: charts.forest(a.summary), strict)
    ok = a.rows[a.rows["status"] == "ok"]
    compiled = _attempt("compile-time table", lambda: compile_table(ok), strict)
    failed = [(d.entry.question or d.entry.name, d.error) for d in drawn if d.error]
    for name, table in (("forest plot", forest), ("compile time", compiled)):
        failed += [(name, table["error"])] if "error" in table else []
    return dict(
        sections=catalogue.sections(drawn, {"throughput": throughput_note(peaks)}),
        skipped=[d for d in drawn if d.skipped],
        failed=failed,
        forest=forest,
        compile=compiled,
    )


def render(
    df: pd.DataFrame | None,
    root: Path,
    links_from: list[Path],
    a: Analysis | None = None,
    strict: bool = False,
) -> list[str]:
    """The report's HTML once per place it will be opened from (trace links are relative), of
    ``df``'s rows or of their analysis ``a``. ``strict``: a figure that fails raises
    (catalogue.FigureFailed) instead of being shown as failed in the page."""
    if a is None:
        path = root / effects.EFFECTS_FILE
        a = analysis.analyze(df, root, analysis.read_csv(path) if path.exists() else None)
    df = a.rows.copy()
    best = best_per_shape(a)
    # a shape with one way has no fastest: no table where no shape has two (issue 74)
    compared = any(pd.to_numeric(b.get("n_ways"), errors="coerce") > 1 for b in best)
    order = {s: i for i, s in enumerate(STATUS_ORDER)}
    df["_order"] = df["status"].map(lambda s: order.get(s, -1))
    shown = [
        c
        for c in TABLE_COLUMNS
        if c in df.columns
        and (c != "fixed" or df[c].map(lambda v: isinstance(v, str) and v != "").any())
    ]  # only when used
    table = df.sort_values(["_order"], kind="stable")[shown]
    on_cuda = "device" in df.columns and df["device"].astype(str).str.startswith("cuda").any()
    overrides, params = read_sweep(root, bool(on_cuda))
    env_path = root / ENV_FILE
    peaks = decoration(root / PEAK_FILE, json.loads, {})
    figures = drawn_figures(a, peaks, strict)
    anchors = {"effects", *(s["id"] for s in figures["sections"]), *(["best"] * compared)}
    said = []
    for f in a.findings:  # each finding links to the section that shows it, when there is one
        anchor = "decode" if f["factor"] == "decode" and "decode" in anchors else f["anchor"]
        if anchor == "regime" and anchor not in anchors:  # its figures need two seq_len
            anchor = "best"
        said.append({**f, "anchor": anchor if anchor in anchors else ""})
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), autoescape=True)
    env.filters["num"] = num
    env.filters["breakable"] = breakable
    context = dict(
        title=f"mha-bench: {root.name}",
        generated=dt.datetime.now().isoformat(timespec="seconds"),
        root=str(root),
        overrides=overrides,
        params=params,
        environment=decoration(env_path, json.loads, {}),
        counts=df["status"].value_counts().to_dict() if len(df) else {},
        n_rows=len(df),
        timing_left=timing_left(df),
        launch_bound=launch_bound_note(df),
        best=best,
        compared=compared,
        best_eager=any(
            b.get("eager_ms") == b.get("eager_ms") and b.get("eager_ms") is not None for b in best
        ),
        legend=legend(best, a.timed),
        findings=said,
        busy=next((f["text"] for f in said if f["factor"] == "busy"), ""),
        threads=threads_note(a.timed),
        effects_busy=bool(
            "busy" in a.summary.columns
            and (pd.to_numeric(a.summary["busy"], errors="coerce").fillna(0) > 0).any()
        ),
        effects=a.summary[a.summary["by"] == "all"].to_dict("records"),
        eager_effects=bool(
            "eager_ratio" in a.summary.columns
            and pd.to_numeric(a.summary["eager_ratio"], errors="coerce").notna().any()
        ),
        figures=figures,
        correctness=correctness_rows(df),
        problems=problem_rows(df),
        verdict=verdicts.report_rows(df),
        timed_any=not a.timed.empty,
        columns=list(table.columns),
        rows=table.to_dict("records"),
        tensorboard_cmd=tensorboard.command(root),
        paired=paired_rows(root),
    )
    template = env.get_template("report.html.j2")
    return [
        template.render(**context, profiles=tensorboard.profile_rows(df, root, where))
        for where in links_from
    ]


def breakable(text) -> Markup:
    """A way's label, escaped, with a line-break opportunity (``<wbr>``) after each "/" and ",":
    "separate/attention=flex,merge=reshape" wraps in a narrow column at its parts."""
    escaped = Markup.escape("" if text is None else str(text))
    return escaped.replace("/", Markup("/<wbr>")).replace(",", Markup(",<wbr>"))


def num(value, fmt: str = "%.4g") -> str:
    """Numbers for tables: short, blank for missing, 'inf' spelled out."""
    if value is None or (isinstance(value, float) and value != value):
        return ""
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, (int, float)):
        return fmt % value
    return str(value)


def report_name(root: Path) -> str:
    """results/sweeps/2026-11-21_10-00-00 -> sweeps-2026-11-21_10-00-00.html"""
    return f"{root.parent.name}-{root.name}.html" if root.parent.name else f"{root.name}.html"


def render_dir(
    root: str | Path,
    report_dir: str | Path = "reports",
    a: Analysis | None = None,
    strict: bool = False,
) -> Path:
    """Render ``root``'s rows (or their analysis ``a``, as the sweep's end made it) to
    ``<root>/report.html`` and a copy under ``report_dir``."""
    root = Path(root).resolve()
    if a is None:
        problems: list[str] = []
        notes: list[str] = []
        a = analysis.load(root, problems, notes)
        for line in problems:  # a damaged row file: said, not a traceback
            print(f"warning: row left out: {line}", file=sys.stderr)
        for line in notes:
            print(f"warning: {line}", file=sys.stderr)
    out = Path(report_dir).resolve() / report_name(root)
    here, there = render(None, root, [root, out.parent], a, strict)
    # first: the run's own copy does not depend on report_dir
    atomic_write_text(root / "report.html", here)
    try:
        atomic_write_text(out, there)
    except WriteError as e:
        raise CopyError(f"{e.strerror} (the report is in {root / 'report.html'})") from e
    return Path(os.path.relpath(out)) if not Path(report_dir).is_absolute() else out


class CopyError(Exception):
    """The report was written into the run/sweep dir, but its copy under report_dir was not."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mha-bench report", description=headline(__doc__))
    parser.add_argument(
        "dir", help="a run or sweep dir (holds results.csv or job dirs with result.csv)"
    )
    parser.add_argument(
        "--report-dir", default="reports", help="where the copy goes (default: reports)"
    )
    args = parser.parse_args(argv)
    root = Path(args.dir)
    if not root.is_dir():
        print(f"error: {args.dir!r} is not a directory", file=sys.stderr)
        return 2
    if not (root / RESULTS_FILE).exists() and not find_rows(root):
        print(
            f"error: {args.dir!r} holds no rows (no {RESULTS_FILE}, no job's {ROW_FILE}): "
            "nothing to report; give the dir of a run or sweep that ran a point",
            file=sys.stderr,
        )
        return 2
    try:
        print(f"report: {render_dir(root, args.report_dir)}")
    except (CopyError, WriteError) as e:
        print(f"error: {e.strerror if isinstance(e, WriteError) else e}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())


def threads_note(timed: pd.DataFrame) -> str:
    """The CPU threads the timed CPU rows ran with, beside the cores (the report's meta line)."""
    if timed.empty or "num_threads" not in timed.columns:
        return ""
    cpu = timed[~timed["device"].astype(str).str.startswith("cuda")] if "device" in timed else timed
    threads = sorted({int(t) for t in pd.to_numeric(cpu["num_threads"], errors="coerce").dropna()})
    cores = pd.to_numeric(cpu.get("cores", pd.Series(dtype=float)), errors="coerce").dropna()
    if not threads or cores.empty:
        return ""
    said = "timed with " + threads_said(threads, int(cores.max()))
    clocks = set(cpu["timed_by"].astype(str)) if "timed_by" in cpu else set()
    if "cpu" in clocks:
        said += (
            "; by the timed thread's CPU time"
            + (" where one thread ran (the wall clock elsewhere)" if "wall" in clocks else "")
            + ": a busy machine's waits are not in the figures (wall_ms_median has the wall "
            "time)"
        )
    return said
