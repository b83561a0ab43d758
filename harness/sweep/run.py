"""Entry point: ``python -m harness [overrides]`` (Hydra). The only module that sees DictConfig.

Composes the config, types it into a ``Point`` and hands it to the job process's worker
(``harness/sweep/worker.py``), which builds, checks and probes it in a process of its own, so that a
crash or hang costs this point's row only. A point to be timed then waits in the worker for its
timing rounds (``harness/measure/rounds.py``): in a sweep whose jobs run in this process, the
harness sweeper has every waiting point timed in interleaved rounds after the last job; otherwise
the job has its own point timed before it returns. Either way this process writes the point's row
to ``<job dir>/result.csv`` as soon as it is checked (``timing_state=pending``) and again once its
rounds are over; each repetition of the rounds is journaled as it ends (``rounds.jsonl``), so
that ``resume=true`` keeps checks and rounds a stopped sweep had finished (``resume_state``).
Gathering and the report happen in ``harness.sweep.callbacks`` at the end of the run or sweep,
or when it is stopped (Ctrl-C, SIGTERM).
"""

from __future__ import annotations

import difflib
import hashlib
import json
import dataclasses
import logging
import os
import re
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from harness.config import RUN_ONLY, TOP_KEYS, InvalidPoint, no_oracle
from harness.envinfo import inherit_gpus
from harness.results import TRACEBACK
from harness.factory import parse_point
from harness.store import register
from harness.schema import Provenance, Record, Timing, check_stands
from harness.progress import PROGRESS, result_line
from harness.measure.journal import JOURNAL_FILE
from harness.results import ROW_FILE, record_job, write_row
from harness.files import Unwritable, WriteError
from harness.sweep.resume import KEPT_DIR, resume_state
from harness.sweep import worker  # the module, not WORKER: submitit pickles main() with its globals

log = logging.getLogger("harness")


def log_to_file(text: str) -> None:
    """``text`` in the run's log files only (Hydra's ``<job>.log``), not on the console, whose one
    line per point says the error already: a failed point's traceback."""
    record = log.makeRecord(log.name, logging.ERROR, __file__, 0, text, None, None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


# An absolute path: relative ones are resolved as Python packages under `python -m`.
CONF_DIR = str(Path(__file__).resolve().parents[2] / "conf")
register()  # the config's keys and defaults, before Hydra composes conf/config.yaml
TRACES_DIR = "traces"  # <run or sweep dir>/traces/<point>/: one TensorBoard run per point


def gpu_for_job() -> str:
    """``device='${gpu_for_job:}'``: with a parallel local launcher on a multi-GPU machine, job n
    runs on GPU n mod the GPU count, so jobs running at once do not share a device."""
    import torch  # only here: the sweep's own process does not import torch otherwise

    count = torch.cuda.device_count()
    return f"cuda:{HydraConfig.get().job.num % count}" if count else "cpu"


OmegaConf.register_new_resolver("gpu_for_job", gpu_for_job, replace=True)


def config_hash(raw: dict) -> str:
    """Fingerprint of the point's full configuration (every key but RUN_ONLY)."""
    kept = {k: v for k, v in raw.items() if k not in RUN_ONLY}
    return hashlib.sha1(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()[:16]


# in a sweep of variant.attention: every kernel (hydra_plugins/mha_bench/sweeper.py, item 7)
KERNELS_VALUE = "kernels()"


def with_kernels(overrides: list[str]) -> list[str]:
    """``variant.attention=kernels()`` (with or without a leading ``+``) spelled out as the
    built-in kernels that need no optional package, in their baseline order."""
    out = []
    for o in overrides:
        key, eq, value = str(o).partition("=")
        if eq and key.lstrip("+~").endswith("attention") and value.strip() == KERNELS_VALUE:
            from harness.way import kernels  # imports each kernel's file (and torch): only then

            o = f"{key}={','.join(kernels.everywhere())}"
        out.append(o)
    return out


def scoped_variant_options(argv: list[str]) -> list[str]:
    """In a sweep, ``variant.K=V`` becomes ``variant.K=choice(V)``: Hydra applies a plain override
    to the sweep's own config too (the default variant's), which fails when that variant has no K.
    As a one-value sweep it reaches only the jobs, where the sweeper sets K in the variants that
    have it (hydra_plugins/mha_bench/sweeper.py). ``variant.attention=kernels()``, which Hydra's
    grammar cannot parse, is spelled out as the sweeper spells a preset's."""
    if not {"-m", "--multirun"} & set(argv):
        return argv
    from hydra.core.override_parser.overrides_parser import OverridesParser

    argv = with_kernels(argv)

    parser, out = OverridesParser.create(), []
    for arg in argv:
        key, eq, value = arg.partition("=")
        if key.startswith("variant.") and eq and value:
            try:
                if not parser.parse_override(arg).is_sweep_override():
                    arg = f"{key}=choice({value})"
            except Exception:  # unparsable: Hydra says so in its own words
                pass
        out.append(arg)
    return out


def refusal(exc: BaseException) -> str:
    """Hydra's error about the command line, in one line: what was wrong and what would do."""
    text = str(exc).strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    first = lines[0] if lines else type(exc).__name__
    override = re.match(r"Could not override '([^']+)'", first)
    if override:  # `foo=1` for a key the config lacks
        key = override.group(1)
        if key.startswith("variant."):  # an option this variant's yaml does not have
            return (
                f"{key} is not an option of this variant (its yaml has no {key.split('.')[1]}; "
                f"+{key}=... would pass it to the constructor anyway)"
            )
        if no_oracle(key):  # a model nn.MHA cannot express: why, not a near name
            return no_oracle(key)
        close = difflib.get_close_matches(key.split(".")[-1], TOP_KEYS, n=1)
        return f"{key} is not a config key" + (f" (did you mean {close[0]}?)" if close else "")
    missing = re.search(r"Could not find '([^'/]+)/([^']+)'", first)
    if missing:  # `sweep=nope`, `variant=nope`
        group, name = missing.groups()
        options = []
        if "Available options" in text:
            after = text.split("Available options", 1)[1].splitlines()[1:]
            options = []
            for line in after:
                if not line.startswith(("\t", "    ")) or not line.strip():
                    break
                options.append(line.strip())
        known = f" (known: {', '.join(options)})" if options else ""
        return f"{group}={name!r} is not in the {group} group{known}"
    if type(exc).__name__ == "OverrideParseException":
        return f"cannot parse the override {getattr(exc, 'override', None) or ''!r}: {first}"
    return first


SWEEPER = "hydra_plugins.mha_bench.sweeper.HarnessSweeper"
BASIC_LAUNCHER = "hydra._internal.core_plugins.basic_launcher.BasicLauncher"


def timed_after_the_jobs(hc) -> bool:
    """Whether this job's point waits for the sweep's interleaved rounds: the harness sweeper
    with Hydra's basic launcher runs every job in its own process and times the waiting points
    after the last one. Any other launcher runs jobs elsewhere: each times its own point."""
    return (
        hc.mode == RunMode.MULTIRUN
        and hc.sweeper.get("_target_") == SWEEPER
        and hc.launcher.get("_target_") == BASIC_LAUNCHER
    )


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def main(cfg: DictConfig) -> str:
    """One point: its row goes to ``<job dir>/result.csv``. Returns the point's config hash
    (the sweeper's job list: results.csv gathers exactly these rows)."""
    inherit_gpus()  # before anything asks CUDA (${gpu_for_job:} below counts the GPUs)
    hc = HydraConfig.get()
    multirun = hc.mode == RunMode.MULTIRUN
    variant_name = hc.runtime.choices.get("variant")
    raw = OmegaConf.to_container(cfg, resolve=True)
    root = Path(hc.sweep.dir if multirun else hc.run.dir)
    job_dir = Path(hc.runtime.output_dir)
    job = hc.job.num if multirun else None
    deferred = timed_after_the_jobs(hc)
    fingerprint = config_hash(raw)
    state, prior = (
        resume_state(job_dir, fingerprint, not raw.get("check_only"), root / KEPT_DIR)
        if raw.get("resume")
        else ("run", None)
    )
    if state == "done":
        log.info(
            PROGRESS.prefix(job)
            + f"skipped     (resume: this point's ok row is already in {job_dir}/{ROW_FILE})"
        )
        record_job(job_dir, fingerprint)
        return fingerprint
    overrides = " ".join(hc.overrides.task)

    def write(record: Record) -> dict:
        """The record's columns, flattened here, where its CSV is written."""
        record.provenance = Provenance(overrides=overrides, config_hash=fingerprint)
        row = record.columns()
        if record.traceback:
            log_to_file(f"{PROGRESS.prefix(job)}{overrides}: {row['error']}\n{record.traceback}")
        try:
            write_row(job_dir, {**row, TRACEBACK: record.traceback})
        except WriteError as e:  # the disk or the dir failed: every later row would be lost too
            raise Unwritable(e) from e
        record_job(job_dir, fingerprint)
        return row

    def timed(record: Record) -> None:  # its rounds are over (maybe after other jobs)
        print(("" if job is None else f"[job {job}] ") + result_line(write(record)), flush=True)

    # Every repetition of its rounds goes to a journal as it ends (harness/measure/journal.py):
    # the sweep's own when its points are timed together, else the job's.
    if deferred:
        journal = (
            str(root.resolve() / JOURNAL_FILE),
            f"{os.path.relpath(job_dir.resolve(), root.resolve())}:{fingerprint}",
        )
    else:
        journal = (str(job_dir.resolve() / JOURNAL_FILE), f"point:{fingerprint}")

    pending: dict = {}  # the row as checked, written before its rounds (``checked``)

    def checked(record: Record) -> None:
        # Its verdict is on disk now, timing pending: a sweep stopped before its rounds end keeps
        # it, and resume=true does not check it again.
        pending.update(write(dataclasses.replace(record, timing=Timing(timing_state="pending"))))

    try:
        point = parse_point(raw, variant_name)
        record, rep_s = worker.WORKER.submit(
            point,
            None if point.check_only else root,
            root / TRACES_DIR,
            job,
            on_row=timed,
            journal=journal,
            prior=prior,
            on_checked=checked,
        )
    except InvalidPoint as e:
        if not multirun:  # a single run with a bad value: say so, no row, non-zero exit
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
        from harness.point import invalid_row

        record, rep_s = invalid_row(raw, variant_name, str(e)), None  # a sweep records it, goes on
    if rep_s is None:
        log.info(PROGRESS.prefix(job) + result_line(write(record)))
        return fingerprint
    # Timed in rounds: in the worker, after the last job when the sweep's jobs run in this
    # process (the sweeper asks), otherwise here and now (a single run, or another launcher).
    if deferred:
        PROGRESS.queue(point.timing.rounds * rep_s)
    kept = prior and check_stands(prior, record.identity.variant_source_hash)
    resumed = "check kept from the earlier run, " if kept else ""
    log.info(PROGRESS.prefix(job) + result_line(pending) + f"  ({resumed}timing: in rounds)")
    if not deferred:
        try:
            worker.WORKER.rounds(say=log.debug)  # a second or two: no round-by-round progress
        except KeyboardInterrupt as e:
            if multirun:  # a job of another launcher: its row is on disk, the sweeper gathers
                raise
            from harness.sweep.callbacks import stopped

            stopped(str(root), cfg, e, single=True)
    return fingerprint
