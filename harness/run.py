"""Entry point: ``python -m harness [overrides]`` (Hydra). The only module that sees DictConfig.

Composes the config, types it into a ``Point``, runs it and writes the point's row to
``<job dir>/result.csv``. Gathering and the report happen in ``harness.callbacks`` at the end
of the run or sweep.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from harness.config import InvalidPoint, parse_point
from harness.point import invalid_row, run_point
from harness.progress import PROGRESS, result_line
from harness.results import write_row

log = logging.getLogger("harness")


# An absolute path: relative ones are resolved as Python packages under `python -m`.
CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def main(cfg: DictConfig) -> None:
    hc = HydraConfig.get()
    multirun = hc.mode == RunMode.MULTIRUN
    variant_name = hc.runtime.choices.get("variant")
    raw = OmegaConf.to_container(cfg, resolve=True)
    try:
        row = run_point(parse_point(raw, variant_name))
    except InvalidPoint as e:
        if not multirun:  # a single run with a bad value: say so, no row, non-zero exit
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
        row = invalid_row(raw, variant_name, str(e))  # in a sweep: record it and go on
    row["overrides"] = " ".join(hc.overrides.task)
    write_row(hc.runtime.output_dir, row)
    log.info(PROGRESS.prefix(hc.job.num if multirun else None) + result_line(row))
