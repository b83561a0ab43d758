"""What a run or a sweep refuses before its first point, each in one line and exit 2
(docs/guide.md, "When something goes wrong"): a single run's bad value; a sweep's value no row
can hold (inf, nan); a job dir outside the sweep's dir. Hydra's callbacks call these first
(harness/sweep/callbacks.py); nothing is written before them."""

from __future__ import annotations

import itertools
import math
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from harness.results import EXIT_REFUSED


def fail(code: int, message: str) -> None:
    """One error line, exit ``code`` (the callbacks' every refusal and failure)."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


def refuse(message: str) -> None:
    fail(EXIT_REFUSED, message)


def valid(config: DictConfig) -> None:
    """A single run's point, typed before anything is written: a bad value is refused in one
    line (exit 2) before the run dir gets its settings, lock and reports dir (a husk that
    ``mha-bench report`` then drew as 0 points)."""
    from harness.config import InvalidPoint
    from harness.factory import parse_point

    task = OmegaConf.to_container(config, resolve=False)
    task.pop("hydra", None)
    try:
        raw = OmegaConf.to_container(OmegaConf.create(task), resolve=True)
    except Exception:  # noqa: BLE001 (an interpolation only the job can resolve: the job checks)
        return
    try:
        parse_point(raw, OmegaConf.select(config, "hydra.runtime.choices.variant"))
    except InvalidPoint as e:
        refuse(str(e))


# Combinations of the other swept values a non-finite value is tried with for the single run's
# words for it (a sweep of 10^4 points is not parsed twice).
SWEEP_TRIALS = 256


def swept_valid(config: DictConfig) -> None:
    """A sweep's values that are no number a row can hold (inf, nan), each refused in one line
    before the first point, as a single run refuses it (exit 2): ``documents=2,inf`` crashed the
    sweep at its second point and left its first row in no results.csv. The value is tried with
    the other swept keys' values for the single run's words. Any other bad value is its point's:
    that point gets its ``invalid`` row and the sweep goes on."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from harness.config import InvalidPoint
    from harness.factory import parse_point

    lines = list(OmegaConf.select(config, "hydra.overrides.task") or [])
    try:
        overrides = OverridesParser.create().parse_overrides(lines)
    except Exception:  # noqa: BLE001 (Hydra itself says what it cannot parse)
        return
    groups = set(OmegaConf.select(config, "hydra.runtime.choices") or {})
    swept, given = {}, {}  # swept keys' values; the other keys the command line sets (one each)
    for o in overrides:
        key = o.get_key_element().lstrip("+~")
        if key in groups or key.startswith("hydra.") or o.is_delete():
            continue
        try:
            if o.is_sweep_override():
                swept[key] = list(o.sweep_iterator())
            else:
                given[key] = [o.value()]
        except Exception:  # noqa: BLE001 (a sweep kind without a finite list: the jobs check)
            continue
    if not swept:
        return
    task = OmegaConf.to_container(config, resolve=False)
    task.pop("hydra", None)
    choice = OmegaConf.select(config, "hydra.runtime.choices.variant")
    # a key given one value is held to the same rule as a swept one
    for key, values in {**given, **swept}.items():
        others = [k for k in swept if k != key]
        combinations = list(itertools.islice(
            itertools.product(*(swept[k] for k in others)), SWEEP_TRIALS
        ))  # fmt: skip
        for value in values:
            if not (isinstance(value, float) and not math.isfinite(value)):
                continue
            refusal = f"{key}={value} is not a finite number"
            for combination in combinations:
                trial = OmegaConf.create(task)
                for other, theirs in zip([key, *others], [value, *combination]):
                    OmegaConf.update(trial, other, theirs, merge=False)
                try:
                    parse_point(OmegaConf.to_container(trial, resolve=True), choice)
                except InvalidPoint as e:
                    if str(e).startswith(f"{key}="):  # the single run's words for it
                        refusal = str(e)
                        break
                except Exception:  # noqa: BLE001 (what only a job can resolve: the job checks)
                    continue
            refuse(f"{refusal} (a value of the sweep's {key}=)")


def inside(config: DictConfig) -> None:
    """A job dir outside the sweep dir (``hydra.sweep.subdir=../x_${hydra.job.num}``) is refused
    before the first point: its rows would be outside what the sweep gathers (it read "(no
    rows)" though every point ran ok)."""
    subdir = str(OmegaConf.to_container(config.hydra.sweep, resolve=False).get("subdir") or "")
    if Path(subdir).is_absolute() or ".." in Path(subdir).parts:
        refuse(
            f"hydra.sweep.subdir={subdir!r} leaves hydra.sweep.dir: each job's dir must be "
            "inside it, where the sweep gathers the rows (the default: ${hydra.job.num})",
        )
