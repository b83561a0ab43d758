"""What the machine was doing while a repetition ran: contention, measured, not assumed.

Why: on a shared machine a busy neighbour slows a repetition down, and intervals, winners and
A/B verdicts built from such repetitions state effects that a quiet re-run contradicts (two
identical sweeps, one run beside busy processes, were called a 5.6x regression). The drift that
pairing with nn.MultiheadAttention cancels is slow; a neighbour that takes the process's cores
is not. So every repetition is read for what it saw (docs/methodology.md,
"How a point is timed", Contention):

- ``cpu_wait``: the time the process's threads spent runnable but waiting for a CPU, over the
  repetition's wall time (Linux schedstat, per thread: ``/proc/self/task/*/schedstat``, field 2,
  ns). Precise to the nanosecond and about the process itself: one busy process beside a
  one-thread run on two cores leaves it at 0; two leave it at ~0.5.
- ``busy_cores``: cores other processes kept busy (``/proc/stat``'s busy time less this
  process's CPU time, over the wall time; jiffies, so about +-0.2 core over 50 ms).
- ``steal``: cores the hypervisor took (``/proc/stat``'s steal), ``cpu_share`` (this process's
  CPU time over wall time, getrusage), ``switches`` (involuntary context switches per second,
  getrusage), ``load`` (``/proc/loadavg``'s 1-minute load).
- on CUDA, ``gpu_others``: processes holding a context on the GPU that are not this run's (NVML's
  list less the processes of this one's session: the sweep's job process, its workers); where
  none of NVML's PIDs is one of ours (a container sees host PIDs) it cannot tell, and says
  nothing (``harness.measure.clocks.processes``).

A repetition is *spoiled* (``spoiled``) when its threads waited for a CPU more than
``SPOILED_WAIT`` of the time, or where schedstat cannot be read when other processes' cores and
this one's threads did not fit in the machine's cores, or when the hypervisor stole more than
``SPOILED_STEAL`` of a core, or when another process shares the GPU. A one-thread CPU point is
timed by its thread's CPU time (the session's ``timed_by`` "cpu"), which holds no wait for a
CPU, and, where the kernel leaves it out (``steal_in_cpu_time``), no steal: for it only what is
still in that time spoils a repetition (steal the kernel charges to it, another process on the
GPU, the process's other threads at work). The rounds re-time a spoiled repetition in a later
round (harness/measure/rounds.py); a point left with too few clean ones is ``contended`` and
decides nothing (harness/report/busy.py).

``Probe`` reads the counters; its sources are arguments so that a test can play a machine.
"""

from __future__ import annotations

import functools
import gzip
import os
import resource
import statistics
import time
from dataclasses import dataclass
from typing import Callable

# A repetition whose threads waited for a CPU more than this share of its wall time is spoiled:
# its time includes a neighbour's. On a quiet 2-core VM the share is 0.000-0.003 (a kernel thread
# now and then); with one busy process per core it is 0.4-0.5 (docs/measurements.md).
SPOILED_WAIT = 0.05
# Without schedstat: other processes' cores plus this one's threads beyond the machine's cores by
# more than this (the jiffies' resolution over a short repetition is about 0.2 core).
SPOILED_CORES = 0.5
SPOILED_STEAL = 0.1  # cores the hypervisor took


@dataclass(frozen=True)
class Counters:
    """One reading of the counters (None: not available on this machine)."""

    wall: float  # s, perf_counter
    cpu: float  # s, this process's user + system time (all threads)
    switches: int  # involuntary context switches of this process
    wait: float | None  # s, this process's threads' time runnable but waiting for a CPU
    busy: float | None  # s, the machine's busy CPU time (all cores, /proc/stat)
    steal: float | None  # s, the machine's stolen time (all cores)
    load: float | None  # 1-minute load average
    gpu_others: int | None  # processes on the GPU that are not this run's (None: cannot tell)


@dataclass(frozen=True)
class Seen:
    """What one repetition saw: the difference of two readings."""

    cpu_wait: float | None  # share of wall time this process's threads waited for a CPU
    busy_cores: float | None  # cores other processes kept busy
    steal: float | None  # cores the hypervisor took
    cpu_share: float  # this process's CPU time over wall time (cores)
    switches: float  # involuntary context switches per second
    load: float | None
    gpu_others: int | None

    def spoiled(self, threads: int, cores: int, clock: str = "wall") -> str | None:
        """Why this repetition's time includes a neighbour's (None: it does not). With the CPU
        clock (``clock="cpu"``: one thread, its CPU time decides) a wait for a CPU is not in the
        figure, so only what is still in it spoils: the hypervisor's steal, a shared GPU."""
        if clock != "cpu" and self.cpu_wait is not None:
            if self.cpu_wait > SPOILED_WAIT:
                return f"its threads waited for a CPU {self.cpu_wait:.0%} of the time"
        elif (
            clock != "cpu"
            and self.busy_cores is not None
            and self.busy_cores + threads > cores + SPOILED_CORES
        ):
            return f"other processes used {self.busy_cores:.1f} of {cores} cores"
        if (
            self.steal is not None
            and self.steal > SPOILED_STEAL
            and (clock != "cpu" or steal_in_cpu_time())
        ):
            return f"the hypervisor took {self.steal:.2f} cores"
        if self.gpu_others:
            return (
                f"{self.gpu_others} other process{'es' if self.gpu_others > 1 else ''} on the GPU"
            )
        return None


@functools.lru_cache(maxsize=None)
def steal_in_cpu_time(paths: tuple[str, ...] = ()) -> bool:
    """Whether time the hypervisor stole is charged to the thread that was running (then it is in
    the CPU clock too). A Linux guest built with CONFIG_PARAVIRT_TIME_ACCOUNTING leaves it out
    (the scheduler's task clock subtracts the steal the hypervisor reports); where the kernel's
    config cannot be read, it is assumed in, and steal spoils a CPU-clock repetition as it does a
    wall-clock one."""
    release = os.uname().release
    for path in paths or ("/proc/config.gz", f"/boot/config-{release}"):
        try:
            if path.endswith(".gz"):
                with gzip.open(path, "rt") as f:
                    text = f.read()
            else:
                with open(path) as f:
                    text = f.read()
        except OSError:
            continue
        return "CONFIG_PARAVIRT_TIME_ACCOUNTING=y" not in text
    return True


def _ticks() -> float:
    try:
        return float(os.sysconf("SC_CLK_TCK"))
    except (ValueError, OSError, AttributeError):
        return 100.0


TICK = _ticks()


def read_stat(path: str = "/proc/stat") -> tuple[float, float] | None:
    """(busy, steal) seconds over every core since boot; None where there is no /proc."""
    try:
        with open(path) as f:
            fields = f.readline().split()
        v = [int(x) for x in fields[1:9]]
    except (OSError, ValueError, IndexError):
        return None
    # user nice system idle iowait irq softirq steal: busy leaves out idle, iowait and steal
    return (v[0] + v[1] + v[2] + v[5] + v[6]) / TICK, v[7] / TICK


def read_wait(task_dir: str = "/proc/self/task") -> float | None:
    """Seconds this process's threads have waited on a run queue (schedstat's run_delay, summed
    over threads); None where the kernel does not keep it."""
    total = 0
    try:
        tasks = os.listdir(task_dir)
    except OSError:
        return None
    seen = False
    for t in tasks:
        try:
            with open(f"{task_dir}/{t}/schedstat") as f:
                total += int(f.read().split()[1])
            seen = True
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended between the listing and the read
    return total / 1e9 if seen else None


def read_load(path: str = "/proc/loadavg") -> float | None:
    try:
        with open(path) as f:
            return float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        try:
            return os.getloadavg()[0]
        except (OSError, AttributeError):
            return None


def usage() -> tuple[float, int]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime, r.ru_nivcsw


class Probe:
    """Reads the counters before and after a repetition. The sources default to this machine's;
    a test passes its own (a fake clock, a played /proc, a fake NVML)."""

    def __init__(
        self,
        clock: Callable[[], float] = time.perf_counter,
        usage: Callable[[], tuple[float, int]] = usage,
        wait: Callable[[], float | None] = read_wait,
        stat: Callable[[], tuple[float, float] | None] = read_stat,
        load: Callable[[], float | None] = read_load,
        gpu: Callable[[], int | None] | None = None,
    ):
        self.clock, self.usage, self.wait, self.stat, self.load, self.gpu = (
            clock,
            usage,
            wait,
            stat,
            load,
            gpu,
        )
        self.has_wait = wait() is not None

    def read(self) -> Counters:
        cpu, switches = self.usage()
        stat = self.stat()
        gpu = None
        if self.gpu is not None:
            try:
                gpu = self.gpu()
            except Exception:  # NVML may refuse a query: no reading, not a failure
                gpu = None
        return Counters(
            wall=self.clock(),
            cpu=cpu,
            switches=switches,
            wait=self.wait() if self.has_wait else None,
            busy=None if stat is None else stat[0],
            steal=None if stat is None else stat[1],
            load=self.load(),
            gpu_others=gpu,
        )


def between(a: Counters, b: Counters) -> Seen:
    """What happened from reading ``a`` to reading ``b``."""
    wall = max(b.wall - a.wall, 1e-9)
    cpu = b.cpu - a.cpu
    wait = None if a.wait is None or b.wait is None else max(0.0, b.wait - a.wait) / wall
    busy = steal = None
    if a.busy is not None and b.busy is not None:
        busy = max(0.0, (b.busy - a.busy) - cpu) / wall
        steal = max(0.0, (b.steal or 0) - (a.steal or 0)) / wall
    return Seen(
        cpu_wait=wait,
        busy_cores=busy,
        steal=steal,
        cpu_share=cpu / wall,
        switches=(b.switches - a.switches) / wall,
        load=b.load,
        gpu_others=b.gpu_others,
    )


# -- a point's rounds in columns ------------------------------------------------------------------


def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def columns(seen: list[Seen], reasons: list[str | None], cores: int) -> dict:
    """The row's contention columns (docs/reference.md) but ``contended`` and
    ``contended_rounds`` (the session's: they count resumed rounds too): medians over this run's
    repetitions (``seen``, each with why it was spoiled or None) and its contention in words."""
    if not seen:
        return {}
    loads = [s.load for s in seen if s.load is not None]
    spoiled = [s for s, why in zip(seen, reasons) if why]
    return dict(
        cpu_wait=_median(s.cpu_wait for s in seen),
        busy_cores=_median(s.busy_cores for s in seen),
        cores=cores,
        steal_cores=_median(s.steal for s in seen),
        cpu_share=_median(s.cpu_share for s in seen),
        switches_per_s=_median(s.switches for s in seen),
        load_avg=max(loads) if loads else None,
        gpu_others=max((s.gpu_others for s in seen if s.gpu_others is not None), default=None),
        contention=f"{words(spoiled, cores, reasons)} ({len(spoiled)} of {len(seen)} repetitions "
        "spoiled)"
        if spoiled
        else None,
    )


def words(spoiled: list[Seen], cores: int, reasons: list[str | None] = ()) -> str:
    """What the spoiled repetitions saw, in one phrase ("" when none was spoiled); ``reasons``
    (why each was spoiled) adds what the machine's counters do not show: the process's own
    other threads at work (``Session``'s CPU clock)."""
    if not spoiled:
        return ""
    parts = []
    own = sum(1 for why in reasons if why and why.startswith("other threads of this process"))
    if own:
        parts.append(f"other threads of this process worked beside the calls in {own}")
    busy = _median(s.busy_cores for s in spoiled)
    if busy is not None:
        parts.append(f"other processes used {busy:.1f} of {cores} cores")
    wait = _median(s.cpu_wait for s in spoiled)
    if wait is not None and wait > SPOILED_WAIT:
        parts.append(f"its threads waited for a CPU {wait:.0%} of the time")
    steal = _median(s.steal for s in spoiled)
    if steal is not None and steal > SPOILED_STEAL:
        parts.append(f"the hypervisor took {steal:.2f} cores")
    others = max((s.gpu_others or 0 for s in spoiled), default=0)
    if others:
        parts.append(f"{others} other process{'es' if others > 1 else ''} on the GPU")
    return "; ".join(parts)
