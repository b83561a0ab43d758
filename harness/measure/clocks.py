"""The GPU's SM clock, power and temperature over a point's rounds (NVML, optional).

Users comparing a figure with a published one ask about clocks first: a GPU that throttles
(power cap, thermal slowdown) runs every kernel slower, and a point timed then is not comparable.
During each repetition, while its calls still run on the GPU (after they are queued, before the
synchronize that ends it: an idle GPU drops its clocks and power), the rounds read NVML through
nvidia-ml-py (``pip install nvidia-ml-py``, the ``gpu`` extra; cuDNN's SDPA benchmark samples
clocks the same way). Where it is absent (or on the CPU) the columns stay empty.
"""

from __future__ import annotations

import functools
import statistics
from typing import Callable

# nvmlClocksThrottleReasons that slow the GPU down on their own: SwPowerCap, HwSlowdown,
# SwThermalSlowdown, HwThermalSlowdown, HwPowerBrakeSlowdown. Idle, application clocks and
# sync boost are not throttling.
THROTTLING = 0x4 | 0x8 | 0x20 | 0x40 | 0x80

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
_WARNED: set = set()


def _field(nv, handle, name: str, calls, say: Callable[[str], None]) -> Callable[[], object]:
    """A reader of one field: at the first reading, the first of ``calls`` this NVML has that
    answers, kept for the next readings. A field no call gives reads None (its column stays
    empty; the others are kept), with one line saying so, once per process."""
    chosen: list = []  # [the call that answered], or [None] once every call failed

    def read():
        if chosen:
            return chosen[0]() if chosen[0] is not None else None
        tried = []
        for fn_name, arg_name in calls:
            fn = getattr(nv, fn_name, None)
            if fn is None:
                continue
            extra = [] if arg_name is None else [getattr(nv, arg_name)]
            call = functools.partial(fn, handle, *extra)
            try:
                value = call()
            except Exception as e:  # this driver lacks it, or refuses it for this GPU
                tried.append(f"{fn_name}: {e}")
                continue
            chosen.append(call)
            return value
        chosen.append(None)
        if name not in _WARNED:
            _WARNED.add(name)
            why = "; ".join(tried) or "no such call"
            say(f"clocks: NVML gives no {name} here ({why}); its column stays empty")
        return None

    return read


def reader(device: str, say: Callable[[str], None] = print) -> Callable[[], Reading] | None:
    """A reading of ``device``'s clocks, or None (CPU, no NVML, a device NVML does not know).
    Each field is read on its own: one that fails is None, the others stay."""
    if not device.startswith("cuda"):
        return None
    nv = nvml()
    if nv is None:
        return None
    try:
        handle = _handle(nv, device)
    except Exception:
        return None
    fields = [_field(nv, handle, name, calls, say) for name, calls in FIELDS]

    def read() -> Reading:
        values = []
        for field in fields:
            try:
                values.append(field())
            except Exception:  # a transient failure: this reading lacks the field
                values.append(None)
        sm, power, temp, reasons = values
        return (sm, None if power is None else power / 1000, temp, reasons)  # power: mW

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
    return out
