"""How a point is measured, defined once: the ``timing`` and ``profiler`` keys (``Timing``,
``ProfilerOptions``) and the between-run floor their intervals carry (``rerun_floor``). Part of
the config (harness/config.py re-exports them), kept apart so that each file holds one job."""

from __future__ import annotations

import math
from dataclasses import dataclass

from harness import floors
from harness.keys import key
from harness.validate import InvalidPoint, choice, flag, number

# timing.rerun_noise=null: the between-run floor of the device kind earned from re-runs (make
# stability, make gpu-check STEP=stability: harness/floors.json, with its date and machine),
# widened where the run's own rounds measure more (stats.drift_floor); where none was earned,
# these assumed values (docs/methodology.md, "How a point is timed").
ASSUMED_FLOOR = {"cpu": 0.04, "cuda": 0.02}
CUDA_FLOOR = ASSUMED_FLOOR["cuda"]


def no_narrower(max_noise: float | None, device: str) -> None:
    """``timing.max_noise`` with ``rerun_noise=null``: above the floor every interval on
    ``device`` has at least (the earned or assumed one), or refused."""
    floor, source = rerun_floor(device)
    least = math.sinh(1.959964 * floor)
    if max_noise is not None and max_noise <= least:
        raise InvalidPoint(
            f"timing.max_noise={max_noise!r} can never be met with the {source} between-run "
            f"floor {floor:.4g} on {device} (harness/floors.json): every interval is at least "
            f"+-{least:.3g} (raise max_noise, or set timing.rerun_noise after make stability)"
        )


def rerun_floor(device: str, in_run: float | None = None) -> tuple[float, str]:
    """The between-run floor of a point on ``device`` with ``timing.rerun_noise=null``, and where
    it comes from: ``earned`` (floors.json), ``rounds`` (``in_run``, measured from the run's
    rounds, is larger and widens it) or ``assumed`` (nothing earned for the device kind)."""
    kind = "cuda" if str(device).startswith("cuda") else "cpu"
    try:
        earned = floors.earned(kind)
    except ValueError as e:  # a damaged floors.json: one line, not a traceback
        raise InvalidPoint(
            f"{e} (restore harness/floors.json with git, or run make stability to earn it again)"
        ) from None
    return floors.floor_rule(earned.value if earned else None, in_run, ASSUMED_FLOOR[kind])


@dataclass(frozen=True)
class Timing:
    """How a point is timed: in rounds of short repetitions, interleaved with every other point
    of the sweep and paired with nn.MultiheadAttention at the same shape (docs/methodology.md)."""

    warmup: float = key(0.05, "s, warm-up by time before the first round (at least 2 calls)")
    rounds: int = key(
        11,
        "repetitions per point, spread over the sweep; the 95% intervals come "
        "from their spread (2 at least)",
    )
    round_time: float = key(0.05, "s, timed calls per repetition (at least one call)")
    retime_rounds: int = key(
        11,
        "rounds after `rounds` that re-time the repetitions contention spoiled (other processes "
        "taking the cores, the hypervisor, another process on the GPU); they stop after 2 in a row "
        "that half their repetitions or more spoiled again; 0: none (docs/methodology.md)",
    )
    when_busy: str = key(
        "go",
        "{choices}: at the first round that contention spoils half of (the console says so at "
        "once), go on timing, or stop the sweep there: exit 3, the points' checks kept, "
        "resume=true times them later (a CI job on a shared runner)",
        choices=("go", "stop"),
    )
    max_noise: float | None = key(
        None,
        "target relative half-width of the interval; null: 0.10 "
        "(must be above the floor rerun_noise puts under every interval, sinh(1.96 x rerun_noise))",
    )
    rerun_noise: float | None = key(
        None,
        "relative sd between two runs that one run's rounds cannot see; null: the device kind's "
        "floor earned from re-runs (harness/floors.json, make stability), widened where the "
        "run's rounds drift more (docs/methodology.md)",
    )
    resident_mb: float | None = key(
        None, "MiB points may hold while waiting for their rounds; null: 1/4 of the device's memory"
    )
    flush_l2: bool = key(True, "CUDA: flush L2 before every call (outside the timed region)")
    cuda_graph: bool = key(
        True,
        "CUDA: time device time by capturing the call once in a CUDA graph and replaying it (no "
        "launch gaps), beside the eager call time; false: the eager call's events only",
    )

    def __post_init__(self):
        for name in ("warmup", "round_time"):
            number(f"timing.{name}", getattr(self, name), 0, unit="a number of seconds >= 0")
        number(
            "timing.rounds",
            self.rounds,
            2,
            integer=True,
            unit="an integer >= 2 (an interval needs two rounds at least)",
        )
        number(
            "timing.rerun_noise",
            self.rerun_noise,
            0,
            below=1,
            none_ok=True,
            unit="a fraction between 0 and 1 (or null: by device)",
        )
        number(
            "timing.max_noise",
            self.max_noise,
            0,
            above=True,
            below=1,
            none_ok=True,
            unit="a fraction between 0 and 1 (or null)",
        )
        number(
            "timing.resident_mb",
            self.resident_mb,
            0,
            none_ok=True,
            unit="a number of MiB >= 0 (or null)",
        )
        number(
            "timing.retime_rounds",
            self.retime_rounds,
            0,
            integer=True,
            unit="an integer >= 0 (rounds that re-time spoiled repetitions)",
        )
        choice("timing.when_busy", self.when_busy, ("go", "stop"))
        flag("timing.flush_l2", self.flush_l2)
        flag("timing.cuda_graph", self.cuda_graph)
        # Against each other: every interval is at least +-sinh(1.96 x rerun_noise) wide (the
        # between-run term), so a smaller noise target could never be met.
        floor = math.sinh(1.959964 * (self.rerun_noise or 0))
        if self.max_noise is not None and self.rerun_noise is not None and self.max_noise <= floor:
            raise InvalidPoint(
                f"timing.max_noise={self.max_noise!r} can never be met with timing.rerun_noise="
                f"{self.rerun_noise!r}: every interval is at least +-{floor:.3g} (lower "
                "rerun_noise after measuring it with make stability, or raise max_noise)"
            )


@dataclass(frozen=True)
class ProfilerOptions:
    """The profiler pass's schedule and what it records (config key ``profiler``)."""

    wait: int = key(1, "schedule: steps skipped per cycle")
    warmup: int = key(1, "schedule: steps run, not recorded, after those")
    active: int = key(3, "schedule: steps recorded per cycle")
    repeat: int = key(1, "cycles")
    record_shapes: bool = key(True, "record the ops' input shapes")
    profile_memory: bool = key(True, "record memory allocations")
    with_stack: bool = key(False, "record Python stacks (larger traces)")

    def __post_init__(self):
        # steps of one call each: 10000 recorded is gigabytes of trace already
        for name in ("wait", "warmup"):
            number(f"profiler.{name}", getattr(self, name), 0, integer=True, below=10001,
                   unit="an integer 0 .. 10000")  # fmt: skip
        for name in ("active", "repeat"):
            number(
                f"profiler.{name}",
                getattr(self, name),
                0,
                above=True,
                integer=True,
                below=10001,
                unit="an integer 1 .. 10000",
            )
        for name in ("record_shapes", "profile_memory", "with_stack"):
            flag(f"profiler.{name}", getattr(self, name))
