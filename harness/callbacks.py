"""Hydra callback: progress for sweeps, and at the end of a run or sweep, results.csv + report.

Registered in conf/config.yaml under ``hydra.callbacks``. The gathering reads the job dirs'
own ``result.csv`` files, so it is the same whichever launcher ran the jobs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from hydra.core.global_hydra import GlobalHydra
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from harness import report
from harness.progress import PROGRESS, case
from harness.envinfo import environment
from harness.results import atomic_write_text, write_results

ENV_FILE = "env.json"

BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"


def sweep_points(config: DictConfig) -> list[list[str]] | None:
    """The basic sweeper's job list, computed the way it does (sweeper params, then the CLI)."""
    if config.hydra.sweeper.get("_target_") != BASIC_SWEEPER:
        return None
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    params = [f"{k}={v}" for k, v in (config.hydra.sweeper.get("params") or {}).items()]
    params += list(config.hydra.overrides.task)
    parser = OverridesParser.create(config_loader=GlobalHydra.instance().config_loader())
    batches = BasicSweeper.split_arguments(parser.parse_overrides(params), None)
    return [job for batch in batches for job in batch]


def check_variants(jobs: list[list[str]]) -> None:
    """An unknown variant is a typo, not a sweep point: stop before any point runs."""
    known = set(GlobalHydra.instance().config_loader().get_group_options("variant"))
    for job in jobs:
        for override in job:
            key, _, value = override.partition("=")
            if key.lstrip("+~") == "variant" and value not in known:
                print(f"error: variant={value!r} is not in the variant group "
                      f"(known: {', '.join(sorted(known))})", file=sys.stderr)
                sys.exit(2)


# With check_only=true these statuses fail the run: the check failed or could not run for a
# reason of the variant's own. oom and unsupported are the machine's limits, reported only.
CHECK_FAILURES = ("mismatch", "error", "invalid")


def check_failures(df) -> list[str]:
    """One line per failing row: variant, case, tensor, max error, tolerance, worst index."""
    lines = []
    for row in df[df["status"].isin(CHECK_FAILURES)].to_dict("records"):
        what = row.get("error") or "check failed"
        lines.append(f"check failed: {row.get('label')} [{case(row)}]: {row.get('status')}: {what}")
    return lines


def finish(root: str, config: DictConfig) -> None:
    """Gather the rows under ``root`` into results.csv, render the report, print its path last.
    With check_only=true, exit 1 after that if any row failed (so CI can gate on it)."""
    path, df = write_results(root)
    counts = df["status"].value_counts().to_dict() if len(df) else {}
    summary = ", ".join(f"{n} {s}" for s, n in counts.items()) or "no rows"
    print(f"results: {path} ({summary})")
    failures = check_failures(df) if config.get("check_only") else []
    for line in failures:
        print(line, file=sys.stderr)
    sys.stderr.flush()
    html = report.render_dir(root, report_dir=config.get("report_dir") or "reports")
    print(f"report: {html}", flush=True)
    if failures:
        sys.exit(1)


def write_env(root: str) -> None:
    """env.json at the run/sweep root: the machine and software the rows were measured on."""
    atomic_write_text(Path(root) / ENV_FILE, json.dumps(environment(), indent=2) + "\n")


class HarnessCallback(Callback):
    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        write_env(OmegaConf.select(config, "hydra.run.dir"))

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        write_env(OmegaConf.select(config, "hydra.sweep.dir"))
        try:
            jobs = sweep_points(config)
        except Exception:  # an override the sweeper itself will reject with its own message
            jobs = None
        if jobs is not None:
            check_variants(jobs)
        PROGRESS.begin(len(jobs) if jobs is not None else None)
        if jobs is not None:
            print(f"sweep: {len(jobs)} points -> {config.hydra.sweep.dir}")

    def on_run_end(self, config: DictConfig, **kwargs) -> None:
        finish(OmegaConf.select(config, "hydra.run.dir"), config)

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        finish(OmegaConf.select(config, "hydra.sweep.dir"), config)
