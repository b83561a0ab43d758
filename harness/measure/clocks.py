"""The GPU's SM clock, power and temperature over a point's rounds (NVML, optional).

Users comparing a figure with a published one ask about clocks first: a GPU that throttles
(power cap, thermal slowdown) runs every kernel slower, and a point timed then is not comparable.
After each repetition, outside the timed region, the rounds read NVML through nvidia-ml-py
(``pip install nvidia-ml-py``, the ``gpu`` extra; cuDNN's SDPA benchmark samples clocks the same
way). Where it is absent (or on the CPU) the columns stay empty.
"""

from __future__ import annotations

import functools
import statistics
from typing import Callable

# nvmlClocksThrottleReasons that slow the GPU down on their own: SwPowerCap, HwSlowdown,
# SwThermalSlowdown, HwThermalSlowdown, HwPowerBrakeSlowdown. Idle, application clocks and
# sync boost are not throttling.
THROTTLING = 0x4 | 0x8 | 0x20 | 0x40 | 0x80

Reading = tuple[int, float, int, int]  # SM clock MHz, power W, temperature C, throttle reasons


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


def reader(device: str) -> Callable[[], Reading] | None:
    """A reading of ``device``'s clocks, or None (CPU, no NVML, a device NVML does not know)."""
    if not device.startswith("cuda"):
        return None
    nv = nvml()
    if nv is None:
        return None
    try:
        handle = _handle(nv, device)
    except Exception:
        return None

    def read() -> Reading:
        return (
            nv.nvmlDeviceGetClockInfo(handle, nv.NVML_CLOCK_SM),
            nv.nvmlDeviceGetPowerUsage(handle) / 1000,  # mW
            nv.nvmlDeviceGetTemperature(handle, nv.NVML_TEMPERATURE_GPU),
            nv.nvmlDeviceGetCurrentClocksThrottleReasons(handle),
        )

    return read


def columns(readings: list[Reading]) -> dict:
    """The row's clock columns from the readings after each repetition (none: no columns)."""
    if not readings:
        return {}
    sm = [r[0] for r in readings]
    return dict(
        sm_clock_mhz_min=min(sm),
        sm_clock_mhz_median=statistics.median(sm),
        power_w_median=statistics.median(r[1] for r in readings),
        temp_c_max=max(r[2] for r in readings),
        throttled=any(r[3] & THROTTLING for r in readings),
    )
