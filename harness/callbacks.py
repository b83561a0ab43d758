"""Hydra callback: env.json at the start of a run or sweep; results.csv + report at the end.

Registered in conf/config.yaml under ``hydra.callbacks``. The gathering reads the job dirs'
own ``result.csv`` files, so it is the same whichever launcher ran the jobs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from harness import ranking, report
from harness.envinfo import environment
from harness.progress import case
from harness.results import atomic_write_text, write_results
from harness.roofline import apply_peaks

ENV_FILE = "env.json"

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
    path, df = write_results(root, transform=lambda rows: apply_peaks(rows, Path(root) / "peak.json"))
    counts = df["status"].value_counts().to_dict() if len(df) else {}
    summary = ", ".join(f"{n} {s}" for s, n in counts.items()) or "no rows"
    print(f"results: {path} ({summary})")
    timed = df[df["n_samples"].notna()] if len(df) else df
    if len(timed):
        ranked = ranking.rank(df)
        atomic_write_text(Path(root) / ranking.RANKING_FILE, ranked.to_csv(index=False))
        winners = int((ranked["winner"] != "").sum())
        print(f"ranking: {Path(root) / ranking.RANKING_FILE} ({winners} shapes with a winner, "
              f"{len(ranked) - winners} ties)")
        noisy = int((~timed["noise_target_met"].astype(bool)).sum())
        print(f"timing: {len(timed)} points timed in {timed['timing_s'].sum():.1f} s, "
              f"{noisy} above their noise target" + (
                  f", {int(timed['recompiles'].sum())} recompilations after the first call"
                  if (timed["compile"] != "off").any() else ""))
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

    def on_run_end(self, config: DictConfig, **kwargs) -> None:
        finish(OmegaConf.select(config, "hydra.run.dir"), config)

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        finish(OmegaConf.select(config, "hydra.sweep.dir"), config)
