"""One analysis of a run's or sweep's rows: the ranking, the effects, their summary and the
findings, made once from the rows and used by everything that shows them.

The sweep's end (harness/sweep/callbacks.py) analyzes the rows it gathered, writes ranking.csv,
effects.csv and effects_summary.csv, prints the findings and renders the report from the same
analysis; ``mha-bench report`` (harness/report/render.py) loads one from a run's files. The
statistics are ranking.py's and effects.py's, the sentences findings.py's (regimes.py's on CUDA).

Torch-free: pandas only.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import yaml

from harness.report import effects, findings, race, ranking
from harness.report.busy import busy_line
from harness.report.regimes import regimes
from harness.report.ways import Ways
from harness.report.ways import load as load_ways
from harness.report.encoding import KERNEL_ORDER
from harness.results import (
    DamagedFile,
    factors,
    left_out_by_method,
    read_csv,
    read_results,
    timed_ok,
    way,
)
from harness.files import atomic_write_text

PAIRED_FILE = "paired.csv"  # mha-bench paired's table, which the report shows when it is there


def prepare(df: pd.DataFrame, ways: Ways = findings.BY_VALUE) -> pd.DataFrame:
    """The rows with the columns the report reads (missing ones empty), each row's ``way``, its
    ``shape`` label (``ranking.shape_labels``, over every row) and its kernel's place in the
    baseline order (``kernel_order``, from ``ways``: how the figures order the kernels)."""
    df = df.copy()
    for col in ("status", "label", "variant", "compile", "sdpa_backend", "latency_ms_median"):
        if col not in df.columns:
            df[col] = None
    records = df.to_dict("records")
    df["way"] = [way(r) for r in records]
    df[KERNEL_ORDER] = [
        ways.kernel_order(f["attention"]) if "attention" in f else None
        for f in map(factors, records)
    ]
    df["shape"] = ranking.shape_labels(df) if len(df) else []
    return df


@dataclass
class Analysis:
    """What the report, the sweep's last lines and ranking/effects files say, made once."""

    rows: pd.DataFrame  # every row, ``prepare``d
    timed: pd.DataFrame  # the correct timed rows, one per configuration (results.timed_ok)
    ranked: pd.DataFrame  # ranking.csv: a winner or a tie per shape
    effects: pd.DataFrame  # effects.csv: a row per pair of ways that differ in one factor
    summary: pd.DataFrame  # effects_summary.csv
    findings: list[dict]  # all_findings: the report's opening sentences
    ways: Ways  # how its ways are named and ordered (ways.json)


def analyze(
    df: pd.DataFrame,
    root: Path | None = None,
    table: pd.DataFrame | None = None,
    ways: Ways | None = None,
) -> Analysis:
    """The analysis of ``df``. The effects are paired round by round from ``root``'s rounds'
    journal (without one: from the rows' speedups), unless ``table`` gives them; the ways are
    named and ordered by ``ways`` (default: ``root``'s ways.json)."""
    ways = load_ways(root) if ways is None else ways
    rows = prepare(df, ways)
    timed = timed_ok(rows)
    ranked = ranking.rank_timed(timed)
    table = effects.pairs(timed, root, ways) if table is None else table
    summary = effects.summarize(table)
    raced = (
        race.race_findings(rows, timed, table, effects.round_times(root, timed))
        if is_race(root)
        else []
    )
    said = all_findings(ranked, table, summary, rows, ways, left_out_by_method(rows), raced)
    return Analysis(rows, timed, ranked, table, summary, said, ways)


def is_race(root: Path | None) -> bool:
    """Whether ``root``'s sweep may be read as a race (``mha-bench race``, the preset
    sweep=race): not when Hydra's record of it names another preset or none. A plain ``run -m``
    with a module of yours ended with "finding: race:" lines nobody asked for (issue 74); rows
    with no record (no root, no multirun.yaml) keep them."""
    record = root / "multirun.yaml" if root is not None else None
    if record is None or not record.is_file():
        return True
    try:
        cfg = yaml.safe_load(record.read_text(encoding="utf-8")) or {}
        choices = cfg["hydra"]["runtime"]["choices"]
    except (OSError, UnicodeDecodeError, yaml.YAMLError, KeyError, TypeError):
        return True  # a damaged record: the rows decide, as before
    return isinstance(choices, dict) and choices.get("sweep") == "race"


def read_rows(
    root: Path, problems: list[str] | None = None, notes: list[str] | None = None
) -> pd.DataFrame:
    """``root``'s results.csv checked against its jobs (``results.read_results``)."""
    return read_results(root, problems, notes)


def load(root: Path, problems: list[str] | None = None, notes: list[str] | None = None) -> Analysis:
    """The analysis of a run's or sweep's files: its rows, and its effects.csv when written
    (the sweep's end pairs them from the rounds' journal). ``problems``: the rows left out;
    ``notes``: other damage read past (a damaged ways.json: the ways named by their values)."""
    path = root / effects.EFFECTS_FILE
    table = None
    try:
        table = read_csv(path) if path.exists() else None
    except DamagedFile as e:  # derived from the rows: paired again from them
        if notes is not None:
            notes.append(f"{e}; the effects are paired again from the rows")
    return analyze(read_rows(root, problems, notes), root, table, load_ways(root, notes))


def write(root: Path, analysis: Analysis) -> None:
    """ranking.csv, effects.csv and effects_summary.csv under ``root``."""
    for name, table in (
        (ranking.RANKING_FILE, analysis.ranked),
        (effects.EFFECTS_FILE, analysis.effects),
        (effects.SUMMARY_FILE, analysis.summary),
    ):
        atomic_write_text(root / name, table.to_csv(index=False))


def all_findings(
    ranked: pd.DataFrame,
    table: pd.DataFrame,
    summary: pd.DataFrame,
    rows: pd.DataFrame | None = None,
    ways: Ways = findings.BY_VALUE,
    left_out: str = "",
    raced: list[str] = (),
) -> list[dict]:
    """Every finding, in order: ``{"factor", "text", "anchor"}`` (anchor: the report's section
    that shows it). The report opens with these and the sweep ends with them. ``rows``: the
    results, for the regimes (CUDA: eager call time against device time) and the decode
    finding. When some timed row stayed contended (a busy machine), the first finding says so
    (``factor`` "busy"): what follows is read in its light; so does ``left_out``, the rows left
    out as timed otherwise than their shape (``factor`` "timing": results.left_out_by_method)."""
    out = []
    busy = busy_line(rows)
    if busy:
        out.append({"factor": "busy", "text": busy, "anchor": "best"})
    if left_out:
        out.append(
            {"factor": "timing", "text": left_out[0].upper() + left_out[1:] + ".", "anchor": "best"}
        )
    out += [{"factor": "race", "text": text + ".", "anchor": "best"} for text in raced]
    fastest = findings.fastest_finding(ranked)
    if fastest:
        out.append({"factor": "fastest", "text": fastest, "anchor": "best"})
    out += regimes(rows, ranked)
    out += [{**f, "anchor": "effects"} for f in findings.findings(summary, table, ways)]
    out += [
        {"factor": "memory", "text": text, "anchor": "memory"}
        for text in findings.memory_findings(table, ways)
    ]
    decode = findings.decode_finding(rows)
    if decode:
        out.append({"factor": "decode", "text": decode, "anchor": "best"})
    return out
