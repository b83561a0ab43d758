"""CUPTI torn down after a CUDA profile, and NVML read while the timed calls run: on the CPU,
with a fake GPU and a fake NVML.

- A CUDA profile (the point's probe, the profiling pass) ends with Kineto asked to tear CUPTI
   down (TEARDOWN_CUPTI=1, read by Kineto when the trace ends), so no tracing stays attached to
   the calls timed afterwards (PyTorch issue 144455: 10-20% slower); no profiler stays enabled.
- NVML is read while the repetition's calls still run on the GPU (before the synchronize that
   waits for them: an idle GPU has dropped its clocks and power), and each of its calls on its
   own: one that fails empties its field only, and is named once on stderr.

No machine speed enters: the fake GPU is busy exactly from a batch's queueing to its
synchronize, and the probe's profiler is a fake that records what Kineto would read.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from harness.config import ProfilerOptions
from harness.measure import clocks, profiling
from harness.measure import session as session_mod
from harness.measure import profiling as probe_mod
from harness.factory import make_point

# ------------------------------------------------------------------------ the profiler probe


class FakeProfile:
    """torch.profiler.profile as the probe and the profiling pass use it, recording what Kineto
    reads when the trace ends (TEARDOWN_CUPTI) instead of tracing. One cycle: the trace handler
    is called once, at the end."""

    seen: list = []

    def __init__(self, *args, on_trace_ready=None, **kwargs):
        self.on_trace_ready = on_trace_ready
        self.profiler = self  # prof.profiler.kineto_results.events()
        self.kineto_results = self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        FakeProfile.seen.append(os.environ.get("TEARDOWN_CUPTI"))
        if self.on_trace_ready is not None:
            self.on_trace_ready(self)
        return False

    def step(self):
        pass

    def events(self):
        return []

    def key_averages(self):
        return []


@pytest.fixture
def fake_cuda_profile(monkeypatch):
    """A CUDA point's probe and profile without a GPU: torch built with ``cuda_version``, the
    allocator's counters at 0, the profiler a FakeProfile; TEARDOWN_CUPTI unset, as in a fresh
    process, and restored after the test."""
    monkeypatch.delenv("TEARDOWN_CUPTI", raising=False)
    FakeProfile.seen = []
    monkeypatch.setattr(probe_mod, "profile", FakeProfile)
    monkeypatch.setattr(profiling, "profile", FakeProfile)
    monkeypatch.setattr(profiling, "tensorboard_trace_handler", lambda *a, **k: lambda prof: None)
    for name in ("synchronize", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda *a: None)
    for name in ("memory_allocated", "max_memory_allocated"):
        monkeypatch.setattr(torch.cuda, name, lambda *a: 0)

    def built_with(cuda_version):
        monkeypatch.setattr(torch.version, "cuda", cuda_version)

    return built_with


def cuda_probe():
    x = torch.randn(4, 4)
    probe_mod.probe(lambda: x @ x, "cuda:0", (1, 1, 4, 4, 4), 4)


def cuda_profile(tmp_path):
    x = torch.randn(4, 4)
    profiling.run_profile(lambda: x @ x, None, "cuda:0", tmp_path, "w", ProfilerOptions())


def test_a_cuda_probe_ends_with_cupti_teardown_asked(fake_cuda_profile):
    """The probe ends its trace with TEARDOWN_CUPTI=1: unset, Kineto leaves CUPTI attached."""
    fake_cuda_profile("12.8")
    cuda_probe()
    assert FakeProfile.seen == ["1"]


def test_a_cuda_profiling_pass_ends_with_cupti_teardown_asked(fake_cuda_profile, tmp_path):
    fake_cuda_profile("13.0")
    cuda_profile(tmp_path)
    assert FakeProfile.seen == ["1"]


@pytest.mark.parametrize(
    "cuda_version, preset, expected",
    [
        ("12.4", None, None),  # below 12.6 a teardown crashes later CUDA-graph captures
        (None, None, None),  # a ROCm or CPU build of torch: no CUPTI
        ("13.0", "0", "0"),  # the user's own choice stands
    ],
)
def test_teardown_is_not_asked_where_it_is_unsafe_or_the_user_chose(
    fake_cuda_profile, monkeypatch, cuda_version, preset, expected
):
    fake_cuda_profile(cuda_version)
    if preset is not None:
        monkeypatch.setenv("TEARDOWN_CUPTI", preset)
    cuda_probe()
    assert FakeProfile.seen == [expected]


def test_no_profiler_is_left_enabled_after_the_probe_and_the_profile(tmp_path):
    """The real torch.profiler on the CPU: after the probe (also one whose call fails) and the
    profiling pass, the rounds that follow run with no profiler enabled, in Python or in C++."""
    x = torch.randn(8, 8)

    def enabled():
        return (
            torch.autograd.profiler._is_profiler_enabled or torch._C._autograd._profiler_enabled()
        )

    probe_mod.probe(lambda: x @ x, "cpu", (1, 1, 8, 8, 8), 4)
    assert not enabled()

    def fails():
        raise RuntimeError("the variant failed under the profiler")

    with pytest.raises(RuntimeError):
        probe_mod.probe(fails, "cpu", (1, 1, 8, 8, 8), 4)
    assert not enabled()
    profiling.run_profile(lambda: x @ x, None, "cpu", tmp_path, "w", ProfilerOptions())
    assert not enabled()


# ---------------------------------------------------------------------------- NVML's reading

BUSY = (1980, 650_000, 61, 0x0)  # SM MHz, mW, C, clock event reasons while the calls run
IDLE = (345, 80_000, 48, 0x1)  # once they are done: idle clocks and power (GpuIdle)


class FakeGPU:
    """A GPU that is busy from the moment a batch is queued to the synchronize that waits for
    it. Its sampler has the real one's ``during`` hook (timing._CudaSampler)."""

    def __init__(self):
        self.busy = False

    def sampler(self, fn, device, flush_l2):
        gpu = self

        class Sampler:
            during = None

            def batch(self, calls, before=None):
                for _ in range(calls):
                    fn()
                gpu.busy = True  # queued: the GPU runs them now
                if self.during is not None:
                    self.during()
                gpu.busy = False  # the synchronize: the GPU is idle again
                return [1.0] * calls

        return Sampler()


class FakeNVML:
    """pynvml for one GPU whose readings follow the FakeGPU; ``broken`` names calls that raise,
    ``breaks_after`` calls that answer at first and raise from their second call on (a GPU that
    stops answering one query mid-run)."""

    NVML_CLOCK_SM, NVML_TEMPERATURE_GPU = 1, 0

    def __init__(self, gpu, broken=(), breaks_after=()):
        self.gpu, self.broken, self.breaks_after = gpu, set(broken), set(breaks_after)
        self.calls: list[str] = []

    def _answer(self, name, index):
        self.calls.append(name)
        if name in self.broken or (name in self.breaks_after and self.calls.count(name) > 1):
            raise RuntimeError(f"{name}: Not Supported")
        return (BUSY if self.gpu.busy else IDLE)[index]

    def nvmlDeviceGetClockInfo(self, handle, kind):
        return self._answer("nvmlDeviceGetClockInfo", 0)

    def nvmlDeviceGetPowerUsage(self, handle):
        return self._answer("nvmlDeviceGetPowerUsage", 1)

    def nvmlDeviceGetTemperatureV(self, handle, sensor):
        return self._answer("nvmlDeviceGetTemperatureV", 2)

    def nvmlDeviceGetTemperature(self, handle, sensor):
        return self._answer("nvmlDeviceGetTemperature", 2)

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle):
        return self._answer("nvmlDeviceGetCurrentClocksEventReasons", 3)

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle):
        return self._answer("nvmlDeviceGetCurrentClocksThrottleReasons", 3)


@pytest.fixture
def fake_gpu(monkeypatch):
    """Session.prepare and repeat on a cuda:0 point, on the FakeGPU, with the FakeNVML that
    ``install`` is given; nothing else of torch.cuda is touched."""
    gpu = FakeGPU()
    monkeypatch.setattr(session_mod, "sampler", gpu.sampler)
    monkeypatch.setattr(session_mod, "use_device", lambda device: None)
    monkeypatch.setattr(session_mod, "memory_in_use", lambda device: 0)
    monkeypatch.setattr(session_mod.torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(clocks, "_handle", lambda nv, device: "gpu0")
    monkeypatch.setattr(clocks, "_WARNED", set(), raising=False)

    def install(**kw) -> FakeNVML:
        nv = FakeNVML(gpu, **kw)
        monkeypatch.setattr(clocks, "nvml", lambda: nv)
        return nv

    gpu.install = install
    return gpu


def timed_rounds(n=3) -> dict:
    """A cuda:0 point through the rounds' own code (prepare, n repetitions): its clock columns."""
    # the eager call's events: no graph to capture on a fake GPU
    timing = {"warmup": 0.0, "rounds": n, "cuda_graph": False}
    point = make_point("fused", device="cpu", timing=timing)
    point = dataclasses.replace(point, device="cuda:0")
    session = session_mod.Session(point, lambda: None, None, nbytes=0, finish=None).prepare()
    session.calls, session.warm = 4, False  # whatever the warm-up measured: no speed enters
    for r in range(n):
        session.repeat(r, "run")
    return clocks.columns(session.clocks)


def test_clocks_describe_the_gpu_while_it_runs_the_timed_calls(fake_gpu):
    """NVML read after the repetition's synchronize would describe an idle GPU (345 MHz, 80 W)."""
    fake_gpu.install()
    cols = timed_rounds()
    assert cols["sm_clock_mhz_min"] == 1980 and cols["sm_clock_mhz_median"] == 1980
    assert cols["power_w_median"] == 650.0 and cols["temp_c_max"] == 61
    assert cols["throttled"] is False


def test_one_refused_nvml_call_empties_its_column_only_and_is_named_once(fake_gpu, capsys):
    """Each of the four fields is read on its own: read in one expression, one refusal would
    drop the whole reading, every clock column empty without a word."""
    fake_gpu.install(broken={"nvmlDeviceGetPowerUsage"})
    cols = timed_rounds()
    assert cols == dict(
        sm_clock_mhz_min=1980,
        sm_clock_mhz_median=1980,
        temp_c_max=61,
        throttled=False,
        power_capped=False,
    )
    warnings = [line for line in capsys.readouterr().err.splitlines() if "clocks:" in line]
    assert len(warnings) == 1 and warnings[0].startswith("warning: ")
    assert "nvmlDeviceGetPowerUsage" in warnings[0] and "power" in warnings[0]


def test_a_call_that_stops_answering_mid_run_is_named_and_the_other_fields_stay(fake_gpu, capsys):
    """A call that answered at the first reading and fails later leaves those readings without
    its field only, and says so once."""
    fake_gpu.install(breaks_after={"nvmlDeviceGetCurrentClocksEventReasons"})
    read = clocks.reader("cuda:0")
    fake_gpu.busy = True
    readings = [read() for _ in range(4)]
    assert [r[3] for r in readings] == [0x0, None, None, None]
    assert all(r[:3] == (1980, 650.0, 61) for r in readings)
    warnings = [line for line in capsys.readouterr().err.splitlines() if "clocks:" in line]
    assert len(warnings) == 1 and "nvmlDeviceGetCurrentClocksEventReasons" in warnings[0]


def test_cuda_13s_calls_first_and_the_deprecated_ones_only_where_the_driver_lacks_them(fake_gpu):
    """nvmlDeviceGetTemperature and nvmlDeviceGetCurrentClocksThrottleReasons are deprecated
    in CUDA 13's NVML (to be removed in 14); an older driver without nvmlDeviceGetTemperatureV
    still gives a temperature, through the old call, without a warning."""
    nv = fake_gpu.install()
    timed_rounds()
    assert "nvmlDeviceGetTemperature" not in nv.calls
    assert "nvmlDeviceGetCurrentClocksThrottleReasons" not in nv.calls
    old = fake_gpu.install(broken={"nvmlDeviceGetTemperatureV"})
    assert timed_rounds()["temp_c_max"] == 61
    assert old.calls.count("nvmlDeviceGetTemperatureV") == 1  # chosen once, not at every reading


def test_a_gpu_nvml_does_not_know_is_named(fake_gpu, monkeypatch):
    fake_gpu.install()

    def unknown(nv, device):
        raise RuntimeError("Not Found")

    monkeypatch.setattr(clocks, "_handle", unknown)
    said = []
    assert clocks.reader("cuda:3", say=said.append) is None
    assert clocks.reader("cuda:3", say=said.append) is None
    assert said == ["clocks: NVML has no handle for cuda:3 (Not Found)"]
