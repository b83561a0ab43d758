"""Hydra callback: env.json at the start of a run or sweep; results.csv + report at the end.

Registered in conf/config.yaml under ``hydra.callbacks``. The gathering reads the job dirs'
own ``result.csv`` files, so it is the same whichever launcher ran the jobs.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from hydra.experimental.callback import Callback
import pandas as pd
from omegaconf import DictConfig, OmegaConf

from harness.sweep import refusals
from harness.sweep.refusals import fail as _fail
from harness.sweep.resume import keep_finished
from harness.sweep.facts import write_ways
from harness.sweep.signals import Deferred, stop_on_sigterm
from harness.report import analysis, effects, ranking, verdicts
from harness.report import render as report
from harness.report import tensorboard
from harness.envinfo import adopt, available_cores, environment, load_average, threads_said
from harness.errors import stop_code, stop_said
from harness.outcome import CHECK_FAILURES, CHECKED
from harness.results import (
    ENV_FILE,
    PEAK_FILE,
    EXIT_FAILED,
    EXIT_REFUSED,
    EXIT_WRITE,
    JOBS,
    timing_left,
    write_jobs,
    write_results,
)
from harness.files import WriteError, atomic_write_text, check_writable
from harness.measure.peakfile import apply_peaks


LOCK_FILE = ".mha-bench.lock"
_LOCKS: dict[str, object] = {}  # open lock files, held until the process ends


def compile_summary(df) -> str:
    """What compiling cost across the sweep (compile=..., or a variant that compiles inside, such
    as attention=flex): first calls that compiled, their seconds, and recompiles while timed,
    which would mean the timed calls were not the steady state."""
    if "compile_s" not in df.columns or not df["compile_s"].notna().any():
        return ""
    compiled = df[df["compile_s"].notna()]
    recompiles = int(df["recompiles"].fillna(0).sum()) if "recompiles" in df.columns else 0
    return (
        f", {len(compiled)} first calls compiled "
        f"{int(compiled['compiled_graphs'].fillna(0).sum())} graphs "
        f"in {compiled['compile_s'].astype(float).sum():.1f} s (column compile_s), "
        f"{recompiles} recompilations while timed"
    )


def check_summary(df) -> tuple[str, bool]:
    """ "checked N (P passed, F failed), unsupported M, ..." and whether the gate passes: no
    failure and at least one point checked."""
    counts = df["status"].value_counts().to_dict() if len(df) else {}
    checked = sum(counts.get(s, 0) for s in CHECKED)
    failed = sum(counts.get(s, 0) for s in CHECK_FAILURES)
    text = (
        f"checked {checked} ({counts.get('ok', 0)} passed, {counts.get('mismatch', 0)} failed), "
        f"unsupported {counts.get('unsupported', 0)}, oom {counts.get('oom', 0)}, did not run "
        f"{sum(counts.get(s, 0) for s in ('error', 'invalid', 'crashed', 'timeout'))} "
        "(error, invalid, crashed, timeout)"
    )
    passed = failed == 0 and checked > 0
    if not passed:
        text += " -- FAILED" + ("" if checked else " (no point was checked)")
    return text, passed


def ranking_said(ranked: pd.DataFrame) -> str:
    """ "2 shapes with a winner, 1 tie": the shapes where ways were compared (one way at a shape
    is no race: its winner would be a tautology)."""
    ranked = ranked[pd.to_numeric(ranked["n_ways"], errors="coerce") > 1]
    if ranked.empty:
        return "one way per shape: nothing to rank"
    busy = int((pd.to_numeric(ranked.get("busy", pd.Series(dtype=float))) > 0).sum())
    winners = int((ranked["winner"].fillna("") != "").sum())
    ties = len(ranked) - winners - busy

    def n(count: int, word: str, plural: str) -> str:
        return f"{count} {word if count == 1 else plural}"

    return f"{n(winners, 'shape', 'shapes')} with a winner, {n(ties, 'tie', 'ties')}" + (
        f", {busy} not ranked: the machine was busy" if busy else ""
    )


def effects_and_findings(root: str, a: analysis.Analysis) -> list[str]:
    """The lines the sweep ends with after the ranking: where the effects are (effects.csv and
    effects_summary.csv, written by ``analysis.write``), then the report's findings (the fastest
    way, each factor's effect)."""
    lines = []
    if len(a.effects):
        lines.append(
            f"effects: {Path(root) / effects.EFFECTS_FILE} ({len(a.effects)} pairs of ways that "
            f"differ in one factor; summary in {effects.SUMMARY_FILE})"
        )
    return lines + [f"finding: {f['factor']}: {f['text']}" for f in a.findings]


def finish(root: str, config: DictConfig, single: bool = False, quiet: bool = False) -> None:
    """Gather this run's rows into results.csv, analyze them once (analysis.py: ranking.csv,
    effects.csv, the findings), render the report of that analysis, print its path last; then
    exit non-zero when CI should fail (results.EXIT_*): rows lost or a file not written, a
    failed or empty check gate (check_only), a single run whose point is not ok. A stop that
    comes meanwhile waits for it (``Deferred``). ``quiet``: a file not written is not said
    (the caller said why; ``cut_short``), its exit code stays."""
    with Deferred():
        _finish(root, config, single, quiet)


def _finish(root: str, config: DictConfig, single: bool, quiet: bool) -> None:
    def unwritten(e: WriteError) -> None:
        if not quiet:
            print(f"error: {e.strerror}", file=sys.stderr)

    problems: list[str] = []
    try:
        write_jobs_listing(root)
        path, df = write_results(
            root,
            transform=lambda rows: apply_peaks(rows, Path(root) / PEAK_FILE),
            problems=problems,
        )
    except WriteError as e:
        unwritten(e)
        sys.exit(EXIT_WRITE)
    for line in problems:
        print(f"warning: row left out: {line}", file=sys.stderr)
    try:
        add_provenance(root, config, df)
    # provenance is extra: never a reason to lose results
    except (OSError, ValueError, TypeError) as e:
        print(f"warning: env.json not updated with the variants' provenance: {e}", file=sys.stderr)
    try:  # the report's names and order of the ways, from their own definitions
        write_ways(root, df, read=asked)
    except (OSError, ValueError, TypeError) as e:
        print(
            f"warning: ways.json not written ({e}): the report names ways by their values",
            file=sys.stderr,
        )
    counts = df["status"].value_counts().to_dict() if len(df) else {}
    summary = ", ".join(f"{n} {s}" for s, n in counts.items()) or "no rows"
    print(f"results: {path} ({summary})")
    code = 0
    if timing_left(df):
        print(f"timing: {timing_left(df)}")
    timed = df[df["n_samples"].notna()] if len(df) else df
    said: list[str] = []
    analyzed = analysis.analyze(df, Path(root))
    try:
        if len(timed):
            analysis.write(Path(root), analyzed)
            print(f"ranking: {Path(root) / ranking.RANKING_FILE} ({ranking_said(analyzed.ranked)})")
            said = effects_and_findings(root, analyzed)
            noisy = int((~timed["noise_target_met"].astype(bool)).sum())
            leaks = int(timed["leak"].isin([True, "True"]).sum())
            print(
                f"timing: {len(timed)} points timed in {timed['timing_s'].sum():.1f} s, "
                f"{noisy} above their noise target"
                + compile_summary(df)
                + (f", {leaks} leaking memory (column leak)" if leaks else "")
            )
    except WriteError as e:
        unwritten(e)
        code = EXIT_WRITE
    for line in said:  # after the counts, before the report's path (always the last line)
        print(line)
    traced = int(df["trace_dir"].fillna("").astype(str).ne("").sum()) if "trace_dir" in df else 0
    if traced:  # profile=true: where its traces went, and what opens them
        print(f"traces: {Path(root) / 'traces'} ({traced} points): {tensorboard.command(root)}")
    if config.get("check_only"):
        for line in verdicts.lines(verdicts.verdicts(df)):  # grouped by way; errors.log: each
            print(line, file=sys.stderr if line.startswith("check failed") else sys.stdout)
        text, passed = check_summary(df)
        print(f"check: {text}")
        if not passed:
            code = code or EXIT_FAILED
    sys.stderr.flush()
    try:
        html = report.render_dir(root, config.get("report_dir") or "reports", analyzed)
        print(f"report: {html}", flush=True)
    except report.CopyError as e:  # the report is in the run/sweep dir; only its copy failed
        print(f"report: {Path(root) / 'report.html'}", flush=True)
        print(f"error: {e}", file=sys.stderr)
        code = EXIT_WRITE
    except WriteError as e:
        unwritten(e)
        code = EXIT_WRITE
    if problems:
        print(
            f"error: {len(problems)} rows could not be read (see the warnings above)",
            file=sys.stderr,
        )
        code = code or EXIT_WRITE
    if single and code == 0 and (len(df) != 1 or df["status"].iloc[0] != "ok"):
        code = EXIT_FAILED  # a single run is a yes/no question: its point is ok or it is not
    sys.stderr.flush()
    if code:
        sys.exit(code)


def stopped(root: str, config: DictConfig, exc: KeyboardInterrupt, single: bool = False) -> None:
    """The end of a run or sweep that was stopped (Ctrl-C, SIGTERM or SIGHUP): gather the rows
    that are on disk (finished points; checked points with their timing pending or partial),
    write the report, and exit 130, 143 or 129."""
    print(
        f"\n{stop_said(exc)}: gathering the points that finished (resume=true completes the rest)",
        file=sys.stderr,
        flush=True,
    )
    try:
        finish(root, config, single=single)
    except SystemExit:  # its own failure was said; the exit code says what stopped the run
        pass
    sys.exit(stop_code(exc))


def cut_short(root: str, config: DictConfig, exc: OSError) -> None:
    """A sweep that could not write a job's files (Hydra's .hydra/ set-up, the point's row: a
    full disk, a read-only dir): one line saying what and where and how to finish, what finished
    gathered and reported where that can still be written (its own failures unsaid: the same
    cause, the same remedy), and exit 3 (a file not written)."""
    said = exc.strerror if isinstance(exc, WriteError) else None
    where = exc.filename or f"the sweep's files under {root}"
    print(
        f"error: {said or f'cannot write {where}: {exc.strerror or exc}'}; the sweep stopped "
        "there (the finished points' rows are in their job dirs: make room or make it "
        "writable, then run it again with resume=true)",
        file=sys.stderr,
        flush=True,
    )
    try:
        finish(root, config, quiet=True)
    except SystemExit:  # its own failure was said
        pass
    sys.exit(EXIT_WRITE)


def write_jobs_listing(root: str) -> None:
    """jobs.json from the jobs this process ran or kept (results.JOBS), so that the gatherer
    takes them and nothing else. Rows from other launchers' processes arrive through the
    sweeper (their JobReturns)."""
    rooted = {
        d: h for d, h in JOBS.items() if Path(d).resolve().is_relative_to(Path(root).resolve())
    }
    write_jobs(root, rooted)  # even empty (interrupted before any row): an old list must not count


def begin(root: str, config: DictConfig) -> None:
    """Before the first point: the output dirs must be writable, and no other sweep may be
    writing into this one (a lock the kernel drops when its holder dies, however it dies)."""
    report_dir = config.get("report_dir") or "reports"
    for path in (root, report_dir):
        try:
            check_writable(path)
        except WriteError as e:
            _fail(EXIT_REFUSED, e.strerror)
    lock_path = Path(root) / LOCK_FILE
    handle = open(lock_path, "a+")
    # the dir itself is locked too: a lock file someone deleted let a second sweep run into the
    # same dir and overwrite three of its rows (issue 74); a dir cannot be deleted from under
    # its lock while the sweep writes in it
    dir_fd = os.open(root, os.O_RDONLY)
    try:
        fcntl.flock(dir_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(dir_fd)
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        _fail(
            EXIT_REFUSED,
            f"{root} is in use by a running sweep ({holder}); wait for it to end "
            "or choose another hydra.sweep.dir / hydra.run.dir",
        )
    handle.seek(0)
    handle.truncate()
    handle.write(
        f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
    )
    handle.flush()
    _LOCKS[str(root)] = (handle, dir_fd)
    JOBS.clear()
    stop_on_sigterm()
    if config.get("resume"):  # finished rows by configuration, before a job can overwrite one
        keep_finished(Path(root))
    write_env(root)
    threads, device = config.get("num_threads"), str(config.get("device") or "")
    if isinstance(threads, int) and threads > available_cores() and not device.startswith("cuda"):
        print(f"warning: {threads_said([threads], available_cores())}", file=sys.stderr)


def add_provenance(root: str, config: DictConfig, df) -> None:
    """env.json gains what only the end of the run knows: each variant class that ran (its
    source hash and distribution), the distributions they came from, the --config-dir in use
    and the torch threads the rows actually used."""
    path = Path(root) / ENV_FILE
    env = json.loads(path.read_text()) if path.exists() else {}
    sources: dict = {}
    if len(df) and "variant_target" in df.columns:
        # every row: one never built (unsupported) lacks its libraries
        for r in df.to_dict("records"):
            if isinstance(r.get("variant_target"), str):
                text = {
                    k: r.get(k) if isinstance(r.get(k), str) else ""
                    for k in ("variant_source_hash", "variant_distribution")
                }  # NaN when empty in the CSV
                entry = sources.setdefault(
                    r["variant_target"],
                    {"source_hash": text["variant_source_hash"], "distribution": []},
                )
                for dist in filter(None, text["variant_distribution"].split("; ")):
                    if dist not in entry["distribution"]:
                        entry["distribution"].append(dist)
    for entry in sources.values():
        entry["distribution"] = "; ".join(entry["distribution"])
    env["variant_sources"] = sources
    env["variant_distributions"] = sorted(
        {d for v in sources.values() for d in v["distribution"].split("; ") if d}
    )
    env["config_dirs"] = [
        str(c.get("path"))
        for c in OmegaConf.select(config, "hydra.runtime.config_sources") or []
        if c.get("provider") == "command-line"
    ]
    threads = df["num_threads"].dropna() if len(df) and "num_threads" in df.columns else []
    env["threads_used"] = sorted({int(t) for t in threads})
    env["contention"] = contention_summary(df)
    atomic_write_text(path, json.dumps(env, indent=2) + "\n")


def contention_summary(df) -> dict:
    """What the rounds saw of the machine, over the run's timed rows (docs/methodology.md,
    "How a point is timed"): points contended, repetitions spoiled, medians of their contention."""
    if not len(df) or "contended_rounds" not in df.columns:
        return {}
    timed = df[df["n_samples"].notna()] if "n_samples" in df.columns else df

    def median(col):
        values = pd.to_numeric(timed.get(col), errors="coerce").dropna()
        return None if values.empty else round(float(values.median()), 3)

    spoiled = pd.to_numeric(timed["contended_rounds"], errors="coerce").fillna(0)
    loads = pd.to_numeric(timed.get("load_avg"), errors="coerce").dropna()
    return {
        "points_timed": int(len(timed)),
        "points_contended": int(timed["contended"].astype(str).str.lower().eq("true").sum()),
        "repetitions_spoiled": int(spoiled.sum()),
        "busy_cores_median": median("busy_cores"),
        "cpu_wait_median": median("cpu_wait"),
        "load_avg_max": None if loads.empty else round(float(loads.max()), 2),
        "load_at_end": load_average(),
    }


def asked(named: list, classes: list) -> tuple[dict, dict]:
    """What the kernels and structures declare (harness/sweep/facts.py), read by the worker."""
    from harness.sweep.facts import definitions
    from harness.sweep.worker import WORKER

    return WORKER.ask("ways", named, classes) or definitions(named, classes)


def write_env(root: str) -> None:
    """env.json at the run/sweep root: the machine and software the rows were measured on, as
    the worker that measures them finds them (this process imports no torch of its own)."""
    from harness.sweep.worker import WORKER

    found = WORKER.ask("env")
    if found is not None:
        adopt(found)
    atomic_write_text(Path(root) / ENV_FILE, json.dumps(environment(), indent=2) + "\n")


def _guarded(step, code: int, *args, **kwargs) -> None:
    """Hydra turns a callback's exception into a warning and exits 0: an unexpected failure at
    the start or the end of a run must instead be one error line and a non-zero exit."""
    try:
        step(*args, **kwargs)
    except Exception as e:  # SystemExit (our own exit codes) passes through
        _fail(code, f"{step.__name__} failed: {type(e).__name__}: {e}")


class HarnessCallback(Callback):
    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        _guarded(refusals.valid, EXIT_REFUSED, config)
        _guarded(begin, EXIT_REFUSED, OmegaConf.select(config, "hydra.run.dir"), config)

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        _guarded(refusals.swept_valid, EXIT_REFUSED, config)
        _guarded(refusals.inside, EXIT_REFUSED, config)
        _guarded(begin, EXIT_REFUSED, OmegaConf.select(config, "hydra.sweep.dir"), config)

    def on_run_end(self, config: DictConfig, **kwargs) -> None:
        _guarded(finish, EXIT_WRITE, OmegaConf.select(config, "hydra.run.dir"), config, single=True)

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        _guarded(finish, EXIT_WRITE, OmegaConf.select(config, "hydra.sweep.dir"), config)
