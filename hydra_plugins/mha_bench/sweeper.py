"""Hydra's basic sweeper with additions for long sweeps of many small jobs.

1. Validation: the basic sweeper composes every job's config up front to catch composition
   errors early, which doubles Hydra's per-job cost (~80 ms a composition here: as much as a
   small point's timing). Every job of a basic sweep has the same override keys; only config
   group choices change which keys exist. So one job per distinct set of group choices is
   composed: the same errors are caught, for a fraction of the cost.
2. Progress: it knows the sweep's size, so each point's line can say "[3/96 ... left]"; and an
   unknown variant name stops the sweep before any point runs (it is a typo, not a point).
3. Ctrl-C (SIGINT) stops the sweep and still writes results.csv and the report of the points
   that finished, then exits 130.
4. Timing in rounds: every point runs in the job process's worker (harness/worker.py: a crash
   or hang costs its own row only). When the launcher runs the jobs in this process (Hydra's
   basic launcher) the points wait in that one worker and the sweeper has them timed in
   interleaved rounds after the last job (harness/rounds.py says why). Other launchers run jobs
   elsewhere; each of those jobs times its own point.

Lives under hydra_plugins/ because Hydra only instantiates sweepers from there. Selected in
conf/config.yaml (``override hydra/sweeper: harness``); ``hydra/sweeper=basic``
gives Hydra's own back.
"""

from __future__ import annotations

import sys
from typing import Sequence

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

from harness.progress import PROGRESS


class HarnessSweeper(BasicSweeper):
    def sweep(self, arguments: list[str]):
        """Jobs, then the timing rounds of the points they left waiting. Ctrl-C ends the sweep
        cleanly: points in their rounds get the rounds they have, and whatever finished is
        gathered and reported."""
        from harness.worker import WORKER

        WORKER.deferred = type(self.launcher).__name__ == "BasicLauncher"  # jobs run in this process
        try:
            returns = super().sweep(arguments)
            WORKER.rounds(say=print)
            self._record_jobs(returns)
            return returns
        except KeyboardInterrupt:
            from harness.callbacks import finish  # the end-of-sweep step, run early

            print("\ninterrupted: gathering the points that finished", file=sys.stderr, flush=True)
            WORKER.kill()
            WORKER.waiting.clear()  # points that never reached their rounds: no row
            finish(self.config.hydra.sweep.dir, self.config)
            sys.exit(130)
        finally:
            WORKER.deferred = False

    @staticmethod
    def _record_jobs(returns) -> None:
        """Jobs that ran in other processes (joblib, submitit) report their row's config hash
        in their return value: the gatherer takes exactly the sweep's rows (results.JOBS)."""
        from hydra.core.utils import JobStatus

        from harness.results import record_job

        for batch in returns or []:
            for r in batch:
                if r.status == JobStatus.COMPLETED and isinstance(r._return_value, str) and r.hydra_cfg:
                    record_job(r.hydra_cfg.hydra.runtime.output_dir, r._return_value)

    def validate_batch_is_legal(self, batch: Sequence[Sequence[str]]) -> None:
        loader = self.hydra_context.config_loader
        if self.batch_index == 1:  # first batch: the whole sweep is known now
            self._check_variants(loader, [job for b in self.overrides for job in b])
        groups: dict[str, bool] = {}

        def is_group(key: str) -> bool:
            if key not in groups:
                groups[key] = bool(loader.get_group_options(key.lstrip("+~")))
            return groups[key]

        seen = set()
        for overrides in batch:
            choices = tuple(o for o in overrides if is_group(o.partition("=")[0]))
            if choices not in seen:
                seen.add(choices)
                cfg = loader.load_sweep_config(master_config=self.config, sweep_overrides=list(overrides))
                self._check_keys(cfg)
        if self.batch_index == 1:  # checked: say what runs
            total = sum(len(b) for b in self.overrides)
            PROGRESS.begin(total)
            print(f"sweep: {total} points -> {self.config.hydra.sweep.dir}", flush=True)

    @staticmethod
    def _check_keys(cfg) -> None:
        """A typo added with ``+key=value`` would run every point with the defaults: refuse it."""
        from omegaconf import OmegaConf

        from harness.config import unknown_key_message

        raw = OmegaConf.to_container(cfg, resolve=False)
        raw.pop("hydra", None)
        message = unknown_key_message(raw)
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
                    print(f"error: variant={value!r} is not in the variant group "
                          f"(known: {', '.join(sorted(known))})", file=sys.stderr)
                    sys.exit(2)
