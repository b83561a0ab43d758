"""The GPU's SM clock, power and temperature over a point's rounds (NVML, optional).

Users comparing a figure with a published one ask about clocks first: a GPU that throttles
(thermal or hardware slowdown) runs every kernel slower, and a point timed then is not
comparable; one at its power cap runs as boards under load do.
During each repetition, while its calls still run on the GPU (after they are queued, before the
synchronize that ends it: an idle GPU drops its clocks and power), the rounds read NVML through
nvidia-ml-py (``pip install nvidia-ml-py``, the ``gpu`` extra; cuDNN's SDPA benchmark samples
clocks the same way). Where it is absent (or on the CPU) the columns stay empty.
"""

from __future__ import annotations

import functools
import os
import statistics
import sys
import time
from typing import Callable

# nvmlClocksThrottleReasons that slow the GPU down on their own: HwSlowdown, SwThermalSlowdown,
# HwThermalSlowdown, HwPowerBrakeSlowdown. Idle, application clocks and sync boost are not
# throttling, and neither is SwPowerCap: a board at its power limit under a heavy kernel (an H100
# running large GEMMs most of the time) is its normal state, in which published figures are
# measured too; it is ``POWER_CAP``, said in its own column.
THROTTLING = 0x8 | 0x20 | 0x40 | 0x80
POWER_CAP = 0x4

# SM clock MHz, power W, temperature C, clock event (throttle) reasons; None: not read
Reading = tuple[int | None, float | None, int | None, int | None]


@functools.lru_cache(maxsize=None)
def nvml():
    """pynvml, initialised; None where nvidia-ml-py or the driver is absent."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml
    except Exception:
        return None


def _handle(nv, device: str):
    """The NVML handle of torch's ``device``, by PCI bus id (NVML numbers GPUs its own way when
    CUDA_VISIBLE_DEVICES reorders them)."""
    import torch

    index = int(device.split(":")[1]) if ":" in device else torch.cuda.current_device()
    bus = getattr(torch.cuda.get_device_properties(index), "pci_bus_id", None)
    if bus is not None:
        domain = getattr(torch.cuda.get_device_properties(index), "pci_domain_id", 0)
        device_id = getattr(torch.cuda.get_device_properties(index), "pci_device_id", 0)
        return nv.nvmlDeviceGetHandleByPciBusId(
            f"{domain:08x}:{bus:02x}:{device_id:02x}.0".encode()
        )
    return nv.nvmlDeviceGetHandleByIndex(index)


# Each field of a reading, and the NVML calls that give it, newest first: CUDA 13's NVML deprecates
# nvmlDeviceGetTemperature and nvmlDeviceGetCurrentClocksThrottleReasons (to be removed in 14).
FIELDS = (
    ("sm_clock", (("nvmlDeviceGetClockInfo", "NVML_CLOCK_SM"),)),
    ("power", (("nvmlDeviceGetPowerUsage", None),)),
    (
        "temperature",
        (
            ("nvmlDeviceGetTemperatureV", "NVML_TEMPERATURE_GPU"),
            ("nvmlDeviceGetTemperature", "NVML_TEMPERATURE_GPU"),
        ),
    ),
    (
        "reasons",
        (
            ("nvmlDeviceGetCurrentClocksEventReasons", None),
            ("nvmlDeviceGetCurrentClocksThrottleReasons", None),
        ),
    ),
)
_WARNED: set = set()  # what was said already: once per process, not at every repetition


def warn(line: str) -> None:
    """The harness's warning line (stderr, as the sweep's other warnings): the clock columns are
    optional, so a missing one never stops a point, but it must not go missing unsaid."""
    print(f"warning: {line}", file=sys.stderr, flush=True)


def _say_once(key, line: str, say: Callable[[str], None]) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        say(line)


def _first(nv, handle, calls) -> tuple[Callable[[], object] | None, str, object, list[str]]:
    """The first of ``calls`` this NVML has that answers: (the call, its name, its value, the
    refusals before it); (None, "", None, refusals) when none does."""
    tried = []
    for fn_name, arg_name in calls:
        fn = getattr(nv, fn_name, None)
        if fn is None:  # an older nvidia-ml-py without the newer call
            continue
        try:
            extra = [] if arg_name is None else [getattr(nv, arg_name)]
            call = functools.partial(fn, handle, *extra)
            return call, fn_name, call(), tried
        except Exception as e:  # this driver lacks it, or refuses it for this GPU
            tried.append(f"{fn_name}: {e}")
    return None, "", None, tried


def _field(nv, handle, name: str, calls, say: Callable[[str], None]) -> Callable[[], object]:
    """A reader of one field that never raises: at the first reading, the first of ``calls``
    that answers, kept for the next readings. A field no call gives reads None (its column stays
    empty; the others are kept); a kept call that fails later (a transient error, a GPU fallen
    off the bus) leaves that reading without the field. Either is said once per process, naming
    the call, so an empty column is never a silent one."""
    chosen: list = []  # [(the call, its name)] once the first reading has chosen

    def read():
        if not chosen:
            call, fn_name, value, tried = _first(nv, handle, calls)
            chosen.append((call, fn_name))
            if call is None:
                why = "; ".join(tried) or "no such call"
                _say_once(
                    name, f"clocks: NVML gives no {name} here ({why}); its column stays empty", say
                )
            return value
        call, fn_name = chosen[0]
        if call is None:
            return None
        try:
            return call()
        except Exception as e:
            _say_once(
                (name, fn_name),
                f"clocks: {fn_name} failed ({e}); readings without it leave {name} out",
                say,
            )
            return None

    return read


def reader(device: str, say: Callable[[str], None] = warn) -> Callable[[], Reading] | None:
    """A reading of ``device``'s clocks, or None (CPU, no NVML, a device NVML does not know).
    Each field is read on its own: one that fails is None, the others stay.

    Call it while the GPU runs the timed calls (after they are queued, before the synchronize
    that waits for them): the rounds do, through ``_CudaSampler.during``. Read after the
    synchronize, it describes an idle GPU whose clocks and power have already dropped."""
    if not device.startswith("cuda"):
        return None
    nv = nvml()
    if nv is None:  # nvidia-ml-py not installed (an optional extra) or no driver: said nowhere
        return None
    try:
        handle = _handle(nv, device)
    except Exception as e:
        _say_once(("handle", device), f"clocks: NVML has no handle for {device} ({e})", say)
        return None
    fields = [_field(nv, handle, name, calls, say) for name, calls in FIELDS]

    def read() -> Reading:
        sm, power, temp, reasons = (field() for field in fields)
        return (sm, None if power is None else power / 1000, temp, reasons)  # power: mW

    return read


def session_pids(proc: str = "/proc") -> set[int]:
    """The processes of this process's session (the sweep's job process, its workers and their
    helpers share it), read from /proc; just this one where there is no /proc."""
    sid, mine = os.getsid(0), {os.getpid()}
    try:
        entries = os.listdir(proc)
    except OSError:
        return mine
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"{proc}/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[3]) == sid:  # after the name: state, ppid, pgrp, session
                mine.add(int(entry))
        except (OSError, ValueError, IndexError):
            continue
    return mine


def others_of(listed: set[int], mine: set[int]) -> int | None:
    """How many of the GPU's processes (NVML's PIDs) are not this run's; None when none of them
    is one of ours: NVML then speaks of another PID namespace (a container sees host PIDs), and
    who is whose cannot be told."""
    if listed and not listed & mine:
        return None
    return len(listed - mine)


def processes(device: str) -> Callable[[], int | None] | None:
    """A reader of how many processes hold a context on ``device`` that are not this run's
    (``others_of``), for the contention of each repetition (harness/measure/contention.py);
    None on the CPU or without NVML."""
    if not device.startswith("cuda"):
        return None
    nv = nvml()
    if nv is None:
        return None
    try:
        handle = _handle(nv, device)
    except Exception:
        return None
    mine: list = [set(), 0.0]  # the session's PIDs, read again every few seconds

    def read() -> int | None:
        listed = {p.pid for p in nv.nvmlDeviceGetComputeRunningProcesses(handle)}
        if time.monotonic() - mine[1] > 5:
            mine[:] = [session_pids(), time.monotonic()]
        return others_of(listed, mine[0])

    return read


def columns(readings: list[Reading]) -> dict:
    """The row's clock columns from the readings taken during the repetitions (none: no
    columns); a field no reading has stays out."""
    if not readings:
        return {}
    out = {}
    sm = [r[0] for r in readings if r[0] is not None]
    if sm:
        out.update(sm_clock_mhz_min=min(sm), sm_clock_mhz_median=statistics.median(sm))
    power = [r[1] for r in readings if r[1] is not None]
    if power:
        out["power_w_median"] = statistics.median(power)
    temp = [r[2] for r in readings if r[2] is not None]
    if temp:
        out["temp_c_max"] = max(temp)
    reasons = [r[3] for r in readings if r[3] is not None]
    if reasons:
        out["throttled"] = any(r & THROTTLING for r in reasons)
        out["power_capped"] = any(r & POWER_CAP for r in reasons)
    return out
