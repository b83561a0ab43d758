"""Hydra's basic sweeper with additions for long sweeps of many small jobs.

1. Validation: the basic sweeper composes every job's config up front to catch composition
   errors early, which doubles Hydra's per-job cost (a composition costs as much as a small
   point's timing). Every job of a basic sweep has the same override keys; only config
   group choices change which keys exist. So one job per distinct set of group choices is
   composed: the same errors are caught, for a fraction of the cost.
2. Progress: it knows the sweep's size, so each point's line can say "[3/96 ... left]"; and an
   unknown variant name stops the sweep before any point runs (it is a typo, not a point).
3. Ctrl-C (SIGINT) or SIGTERM stops the sweep and still writes results.csv and the report of the
   points that finished (and of those checked, their timing pending), then exits 130 or 143.
4. Timing in rounds: every point runs in the job process's worker (harness/sweep/worker.py: a crash
   or hang costs its own row only). When the launcher runs the jobs in this process (Hydra's
   basic launcher) the points wait in that one worker and the sweeper has them timed in
   interleaved rounds after the last job (harness/measure/rounds.py says why). Other launchers
   run jobs elsewhere; each of those jobs times its own point.
5. Order: the ways of one shape run one after another whatever the order of the overrides
   (``shapes_together``), so that the float64 oracle of a shape is computed once for all of them.
6. Unions: ``params`` (and ``cuda_params``) may be a list of sweeps, run as one: a preset that
   sweeps decode steps and prefills (``sweep=llm``) is not their product. The command line's
   overrides apply to each.
7. ``variant.attention=kernels()`` sweeps every built-in kernel that needs no optional package,
   in their baseline order (harness/way/kernels.py, ``everywhere``): a preset that says it runs the
   kernels a new kernel file adds without an edit.

Lives under hydra_plugins/ because Hydra only instantiates sweepers from there. Selected in
conf/config.yaml (``override hydra/sweeper: harness``); ``hydra/sweeper=basic``
gives Hydra's own back.
"""

from __future__ import annotations

import functools

import os
import sys
from typing import Sequence

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

from harness.config import keys_with
from harness.envinfo import PARENT_GPUS
from harness.progress import PROGRESS
from harness.sweep.run import with_kernels


# Overrides that change the way of writing attention, how it is measured or how the run goes,
# not the shape (config.ROLES): the float64 oracle and nn.MHA's own error (harness/point.py:
# oracle_tensors, reference_tensors) are the same for every way at one shape, and are computed
# once for consecutive points of one shape.
WAY_KEYS = keys_with("way", "measure", "run")
WAY_PREFIXES = ("variant.", "timing.", "profiler.")


@functools.lru_cache(maxsize=None)  # a pure function of the text; jobs repeat their overrides
def _readable(override: str) -> str:
    """A job's override as Hydra's grammar reads it: the sweep hands each job its value bare,
    without the quotes it was given in (``variant.tag='a<b'`` reached the job as ``a<b``, which
    the grammar refuses, while a single run took it); such a value is quoted again."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        OverridesParser.create().parse_override(override)
        return override
    except Exception:  # noqa: BLE001 (the grammar's refusal: quote the value and try that)
        key, eq, value = override.partition("=")
        escaped = value.replace("\\", "\\\\").replace("'", "\\'")
        quoted = f"{key}='{escaped}'"
        try:
            OverridesParser.create().parse_override(quoted)
            return quoted
        except Exception:  # noqa: BLE001 (not a quoting matter: Hydra says why, as before)
            return override


def _spelled(params) -> dict:
    """A preset's ``params`` with ``kernels()`` spelled out (``with_kernels``)."""
    items = [f"{k}={v}" for k, v in params.items()]
    return dict(o.split("=", 1) for o in with_kernels(items))


def shapes_together(jobs: list[list[str]]) -> list[list[str]]:
    """The jobs reordered so that the ways of one shape run one after another, whatever the order
    of the overrides (``seq_len=128,512 variant=a,b`` as ``variant=a,b seq_len=128,512``): shapes
    in the order they first appear, the ways of each in the order given."""

    def shape(job: list[str]) -> tuple:
        keys = [o for o in job if not _is_way(o.partition("=")[0].lstrip("+~"))]
        return tuple(keys)

    first: dict[tuple, int] = {}
    for job in jobs:
        first.setdefault(shape(job), len(first))
    return sorted(jobs, key=lambda job: first[shape(job)])  # stable: ways keep their order


def windows_where_sliding(jobs: list[list[str]], mask: str = "none") -> list[list[str]]:
    """``mask=causal,sliding window=W`` in one sweep: the window applies to the sliding points;
    the others run without it (their ``window`` override is dropped, so their row's window is
    empty) and once, however many windows are swept. In a sweep with no sliding point a window
    is left where it is, and each point refuses it (``invalid``): it is a mistake there.
    ``mask``: the config's, for a job that does not set one."""

    def value(job: list[str], key: str, default: str) -> str:
        given = [o.partition("=")[2] for o in job if o.partition("=")[0].lstrip("+~") == key]
        return given[-1] if given else default

    if not any(value(job, "mask", mask) == "sliding" for job in jobs):
        return jobs
    kept, seen = [], set()
    for job in jobs:
        if value(job, "mask", mask) != "sliding":
            job = [o for o in job if o.partition("=")[0].lstrip("+~") != "window"]
        if tuple(job) not in seen:
            seen.add(tuple(job))
            kept.append(job)
    return kept


def _is_way(key: str) -> bool:
    return key in WAY_KEYS or key.startswith(WAY_PREFIXES)


# The submitting process's CUDA_VISIBLE_DEVICES, for submitit_local's jobs (inherit_gpus).


def slurm_gpus(launcher) -> int | None:
    """GPUs a SLURM launcher asks for each job (submitit's gpus_per_node, gpus_per_task, or a
    gres of ``gpu[:type]:N``): 0 when it asks none; None for a launcher that runs jobs here."""
    if launcher is None or type(launcher).__name__ != "SlurmLauncher":
        return None
    params = getattr(launcher, "params", None) or {}
    for key in ("gpus_per_node", "gpus_per_task"):
        value = params.get(key)
        if value:  # an int, or SLURM's "type:N"
            return int(str(value).rsplit(":", 1)[-1]) if str(value)[-1].isdigit() else 1
    for entry in str(params.get("gres") or "").split(","):  # gpu, gpu:N, gpu:type:N
        parts = entry.strip().split(":")
        if parts[0] == "gpu":
            return int(parts[-1]) if len(parts) > 1 and parts[-1].isdigit() else 1
    return 0


def on_cuda(config_device, arguments: list[str], launcher=None) -> bool:
    """Whether the sweep's points run on CUDA: ``device=`` on the command line (every value of a
    sweep over it), else the config's. ``auto`` is CUDA where the jobs will see a GPU: with SLURM,
    where the launcher asks for GPUs (the submitting login node's own GPUs say nothing about the
    compute nodes'); otherwise where torch sees one here."""
    asked = [a.partition("=")[2] for a in arguments if a.partition("=")[0].lstrip("+") == "device"]
    values = asked[-1].split(",") if asked else [str(config_device)]
    if any(v == "auto" or "gpu_for_job" in v for v in values):
        gpus = slurm_gpus(launcher)
        if gpus is not None:
            return gpus > 0
        from harness.envinfo import sees_cuda

        return sees_cuda()
    return all(v.startswith("cuda") for v in values)


def jobs_on_gpus(launcher, gpu_count: int, spread: bool) -> tuple[int | None, str | None]:
    """What a launcher that runs jobs in other processes needs on a CUDA machine so that the
    device asked for is the device used: (the most jobs to run at once, or None: as it is; a
    line for the log). ``spread``: ``device=${gpu_for_job:}`` gives each job of a batch its own
    GPU.

    submitit's local launcher starts every job with CUDA_VISIBLE_DEVICES set to its first
    ``gpus_per_node`` GPUs, "" by default: a GPU sweep ran on the CPU. Given none, its jobs see
    every GPU, and run one at a time (all of a batch start at once, on the same GPU) or one per
    GPU at a time when spread. joblib's parallel jobs on one device distort each other: a
    warning."""
    kind = type(launcher).__name__
    if not gpu_count:
        return None, None
    if kind == "LocalLauncher":
        # submitit numbers the GPUs it hands a job 0..n-1, which CUDA reads as the machine's
        # first n, whatever this process's CUDA_VISIBLE_DEVICES says: the jobs map them back
        # through it (harness.envinfo.inherit_gpus).
        parent = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        if parent:
            os.environ[PARENT_GPUS] = parent
    if kind == "LocalLauncher" and not launcher.params.get("gpus_per_node"):
        launcher.params["gpus_per_node"] = gpu_count
        at_once = gpu_count if spread else 1
        return at_once, (
            f"submitit_local: jobs see the {gpu_count} GPU(s) (hydra.launcher.gpus_per_node="
            f"{gpu_count}) and run {at_once} at a time, so that no two share a GPU"
            + ("" if spread or gpu_count == 1 else "; device=${gpu_for_job:} runs one per GPU")
        )
    n_jobs = (getattr(launcher, "joblib", None) or {}).get("n_jobs")
    if kind == "JoblibLauncher" and spread and isinstance(n_jobs, int) and 0 < n_jobs <= gpu_count:
        return None, None  # no more at once than there are GPUs: one per GPU already
    if kind == "JoblibLauncher" and n_jobs != 1 and spread:
        # job n runs on GPU n mod the count: batches of one job per GPU keep them apart
        return gpu_count, (
            f"joblib: device=${{gpu_for_job:}} runs {gpu_count} job(s) at a time, one per GPU "
            f"(n_jobs={n_jobs} would put several on one)"
        )
    if kind == "JoblibLauncher" and n_jobs != 1:
        return None, (
            f"warning: joblib runs n_jobs={n_jobs} jobs at once on the same GPU: their timings "
            "distort each other; use device=${gpu_for_job:} (one job per GPU) or n_jobs=1"
        )
    return None, None


class HarnessSweeper(BasicSweeper):
    def __init__(self, max_batch_size=None, params=None, cuda_params=None):
        """``cuda_params``: a preset's sweep for a sweep that runs on CUDA (its GPU-sized shapes),
        used in place of ``params`` there; the command line's overrides apply to either."""
        super().__init__(max_batch_size, params)
        self.cuda_params = cuda_params

    def sweep(self, arguments: list[str]):
        """Jobs, then the timing rounds of the points they left waiting. Ctrl-C ends the sweep
        cleanly: points in their rounds get the rounds they have, and whatever finished is
        gathered and reported."""
        from harness.files import Unwritable
        from harness.sweep.worker import WORKER

        cuda = on_cuda(self.config.get("device", "auto"), arguments, self.launcher)
        if self.cuda_params and slurm_gpus(self.launcher) is not None:
            print(  # decided by the launcher, not by this node: say so
                f"shapes: {'the GPU-sized cuda_params' if cuda else 'the CPU params'} of the "
                f"preset: submitit_slurm asks {slurm_gpus(self.launcher)} GPU(s) per job",
                flush=True,
            )
        if self.cuda_params and cuda:
            self.params = self.cuda_params
        # a list of sweeps: their union (split_arguments); Hydra's own code sees none of them
        self.union = None
        arguments = with_kernels(arguments)
        if self.params is not None and not hasattr(self.params, "items"):
            self.union = [_spelled(p) for p in self.params]
            self.params, self.arguments = {}, list(arguments)
        elif self.params is not None:
            self.params = _spelled(self.params)
        if cuda:
            import torch

            at_once, note = jobs_on_gpus(
                self.launcher, torch.cuda.device_count(), any("gpu_for_job" in a for a in arguments)
            )
            if at_once is not None:
                self.max_batch_size = min(self.max_batch_size or at_once, at_once)
            if note:
                print(note, flush=True)

        try:
            returns = super().sweep(arguments)
            # The points that jobs run in this process left waiting (harness.sweep.run decides
            # from the launcher); none with another launcher.
            WORKER.rounds(say=lambda text: print(text, flush=True))  # a log file follows it too
            self._record_jobs(returns)
            return returns
        except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (harness.errors.Terminated)
            self._stopped(e)
        except (Exception, Unwritable) as e:  # Unwritable: a BaseException (harness/files.py)
            from harness.errors import stop_within

            if stop_within(e) is not None:  # a stop a library's cleanup turned into its error
                self._stopped(stop_within(e))
            elif isinstance(e, (OSError, Unwritable)):  # a job's files (Hydra's .hydra/, its
                from harness.sweep.callbacks import cut_short  # row) not written: a full disk

                WORKER.kill()
                WORKER.waiting.clear()
                cut_short(self.config.hydra.sweep.dir, self.config, getattr(e, "error", e))
            else:
                raise

    def _stopped(self, stop: KeyboardInterrupt) -> None:
        """The end-of-sweep step, run early: what finished is gathered and reported."""
        from harness.sweep.callbacks import stopped
        from harness.sweep.worker import WORKER

        WORKER.kill()
        # points that never reached their rounds: their rows say timing pending
        WORKER.waiting.clear()
        stopped(self.config.hydra.sweep.dir, self.config, stop)

    @staticmethod
    def _record_jobs(returns) -> None:
        """Jobs that ran in other processes (joblib, submitit) report their row's config hash
        in their return value: the gatherer takes exactly the sweep's rows (results.JOBS)."""
        from hydra.core.utils import JobStatus

        from harness.results import record_job

        for batch in returns or []:
            for r in batch:
                if (
                    r.status == JobStatus.COMPLETED
                    and isinstance(r._return_value, str)
                    and r.hydra_cfg
                ):
                    record_job(r.hydra_cfg.hydra.runtime.output_dir, r._return_value)

    def _is_group(self, key: str) -> bool:
        groups = self.__dict__.setdefault("_groups", {})
        if key not in groups:
            groups[key] = bool(self.hydra_context.config_loader.get_group_options(key.lstrip("+~")))
        return groups[key]

    # BasicSweeper's is static; called on self
    def split_arguments(self, overrides, max_batch_size):
        jobs = [job for batch in BasicSweeper.split_arguments(overrides, None) for job in batch]
        if getattr(self, "union", None):
            from hydra.core.override_parser.overrides_parser import OverridesParser

            parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
            jobs, seen = [], set()
            for params in self.union:
                given = [f"{k}={v}" for k, v in params.items()] + self.arguments
                for batch in BasicSweeper.split_arguments(parser.parse_overrides(given), None):
                    for job in batch:
                        if tuple(job) not in seen:
                            seen.add(tuple(job))
                            jobs.append(job)
        jobs = [[_readable(o) for o in job] for job in jobs]
        mask = str(getattr(self, "config", None) and self.config.get("mask", "none") or "none")
        jobs = shapes_together(windows_where_sliding(self._scope_variant_options(jobs), mask))
        n = max_batch_size or len(jobs) or 1
        return [jobs[i : i + n] for i in range(0, len(jobs), n)]

    def _scope_variant_options(self, jobs: list[list[str]]) -> list[list[str]]:
        """``variant.K=V`` in a sweep over several variants sets K where the variant's yaml has it
        and is left out for the others (an option of one module is not a typo for the rest); a job
        left identical to another by that runs once. K in no swept variant's yaml is refused."""
        if not any(o.startswith("variant.") for job in jobs for o in job):
            return jobs
        from harness.declarations import DECLARATION_KEYS

        loader = self.hydra_context.config_loader
        # an unknown variant name cannot be composed: say that first
        self._check_variants(loader, jobs)
        composed: dict[tuple, tuple[str, set]] = {}
        having: dict[str, set] = {}  # option key -> variants whose yaml has it
        lacking: dict[str, set] = {}
        kept, seen = [], set()
        for job in jobs:
            choices = tuple(o for o in job if self._is_group(o.partition("=")[0]))
            if choices not in composed:
                cfg = loader.load_sweep_config(
                    master_config=self.config, sweep_overrides=list(choices)
                )
                composed[choices] = (
                    cfg.hydra.runtime.choices.get("variant"),
                    set(cfg.get("variant") or {}),
                )
            name, keys = composed[choices]
            out = []
            for o in job:
                key = o.partition("=")[0]
                if key.startswith("variant."):
                    top = key.split(".")[1]
                    (having if top in keys else lacking).setdefault(key, set()).add(name)
                    if top not in keys:
                        continue
                out.append(o)
            if tuple(out) not in seen:
                seen.add(tuple(out))
                kept.append(out)
        for key in sorted(lacking):
            if key not in having:
                variants = {n: k - {"_target_", *DECLARATION_KEYS} for n, k in composed.values()}
                options = "; ".join(
                    f"{n}: {', '.join(sorted(k)) or 'none'}" for n, k in sorted(variants.items())
                )
                print(
                    f"error: {key} is not an option of any variant in this sweep ({options})",
                    file=sys.stderr,
                )
                sys.exit(2)
            print(
                f"note: {key} applies to {', '.join(sorted(having[key]))}; left out for "
                f"{', '.join(sorted(lacking[key]))} (no such option)",
                flush=True,
            )
        if len(kept) < len(jobs):
            print(
                f"note: {len(jobs) - len(kept)} points left out: "
                "the same point as another once the options a variant lacks are left out",
                flush=True,
            )
        return kept

    def validate_batch_is_legal(self, batch: Sequence[Sequence[str]]) -> None:
        loader = self.hydra_context.config_loader
        if self.batch_index == 1:  # first batch: the whole sweep is known now
            self._check_variants(loader, [job for b in self.overrides for job in b])
        is_group = self._is_group

        seen = set()
        for overrides in batch:
            choices = tuple(o for o in overrides if is_group(o.partition("=")[0]))
            if choices not in seen:
                seen.add(choices)
                cfg = loader.load_sweep_config(
                    master_config=self.config, sweep_overrides=list(overrides)
                )
                self._check_keys(cfg)
        if self.batch_index == 1:  # checked: say what runs
            total = sum(len(b) for b in self.overrides)
            PROGRESS.begin(total)
            print(f"sweep: {total} points -> {self.config.hydra.sweep.dir}", flush=True)

    @staticmethod
    def _check_keys(cfg) -> None:
        """A typo added with ``+key=value`` would run every point with the defaults: refuse it."""
        from omegaconf import OmegaConf

        from harness.declarations import DECLARATION_KEYS, parse_declaration
        from harness.config import InvalidPoint, unknown_key_message

        raw = OmegaConf.to_container(cfg, resolve=False)
        name = cfg.hydra.runtime.choices.get("variant")
        raw.pop("hydra", None)
        message = unknown_key_message(raw)
        if not message:  # a variant's declarations are checked before its first point, too
            try:
                for kind in DECLARATION_KEYS:
                    parse_declaration(
                        (raw.get("variant") or {}).get(kind), f"variant={name}: {kind}", kind
                    )
            except InvalidPoint as e:
                message = str(e)
        if message:
            print(f"error: {message}", file=sys.stderr)
            sys.exit(2)

    @staticmethod
    def _check_variants(loader, jobs: list[Sequence[str]]) -> None:
        known = set(loader.get_group_options("variant"))
        for job in jobs:
            for override in job:
                key, _, value = override.partition("=")
                if key.lstrip("+~") == "variant" and value not in known:
                    print(
                        f"error: variant={value!r} is not in the variant group "
                        f"(known: {', '.join(sorted(known))})",
                        file=sys.stderr,
                    )
                    sys.exit(2)
