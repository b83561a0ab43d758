"""Measurement: FLOP model, noise rule, probes (memory, SDPA kernel, materialised scores),
compile bookkeeping, roofline lookups, env.json/peak.json. CUDA-only cases skip without CUDA."""

import json
import time

import pandas as pd
import pytest
import torch

from harness import flops
from harness.point import run_point
from harness.measure.roofline import datasheet_peak
from harness.factory import make_point
from harness.measure.timing import Window, measure, relative_noise
from tests.conftest import TINY

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
QUICK = dict(warmup=0.001, rounds=3, round_time=0.005)


def point(name="fused", device="cpu", timing=QUICK, **fields):
    fields.setdefault("variant", fields.pop("options", {}))
    return make_point(
        name,
        batch=2,
        seq_len=fields.pop("seq_len", 64),
        embed_dim=64,
        num_heads=4,
        device=device,
        timing=timing,
        **fields,
    )


def test_flop_model_by_hand():
    B, L, S, E = 2, 8, 4, 16
    proj = 2 * B * L * E * E * 2 + 2 * B * S * E * E * 2
    attn = 4 * B * L * S * E
    assert flops.mha_flops(B, L, S, E, causal=False, mode="fwd") == proj + attn
    assert flops.mha_flops(B, L, S, E, causal=True, mode="fwd") == proj + attn / 2
    assert flops.mha_flops(B, L, S, E, causal=False, mode="fwd_bwd") == 3 * proj + 3.5 * attn
    assert flops.tflops(1e12, 1000.0) == pytest.approx(1.0)


def test_noise_is_the_relative_standard_error_of_the_median():
    assert relative_noise([1.0] * 10) == 0
    spread = [1.0, 1.1, 0.9, 1.05, 0.95] * 4
    assert relative_noise(spread * 4) == pytest.approx(
        relative_noise(spread) / 2, rel=1e-6
    )  # 1/sqrt(n)
    assert relative_noise([1.0]) == float("inf")


def test_timer_stops_once_quiet_and_reports_its_spread():
    r = measure(
        lambda: time.sleep(0.001),
        "cpu",
        Window(warmup=0, min_samples=8, min_time=0.02, max_time=5, max_noise=0.5),
    )
    assert r.noise_target_met and r.window_s < 1  # stopped on noise long before max_time
    assert r.p10_ms <= r.median_ms <= r.p90_ms and r.iqr_ms >= 0
    strict = measure(
        lambda: time.sleep(0.0005),
        "cpu",
        Window(warmup=0, min_samples=2, min_time=0, max_time=0.05, max_noise=1e-9),
    )
    assert not strict.noise_target_met and strict.window_s < 1  # gave up at max_time


def test_row_throughput_is_consistent():
    row = run_point(point(mask="causal"), peak_tflops=0.5)
    assert row["status"] == "ok", row
    assert row["flops"] == flops.mha_flops(2, 64, 64, 64, causal=True, mode="fwd")
    timing = {
        k: v for k, v in row.items() if k.startswith(("latency", "n_", "contended", "tflops"))
    }
    assert row["tflops"] == pytest.approx(
        row["flops"] / (row["latency_ms_median"] * 1e-3) / 1e12
    ), timing  # once in CI under load: no median (why: the timing columns say)
    assert row["pct_of_peak"] == pytest.approx(100 * row["tflops"] / 0.5)
    for col in (
        "latency_ms_p10",
        "latency_ms_p90",
        "noise",
        "timing_s",
        "peak_mem_mb",
        "num_threads",
        "latency_ms_ci_low",
        "latency_ms_ci_high",
        "speedup",
        "speedup_ci_low",
        "speedup_ci_high",
    ):
        assert row[col] is not None and row[col] == row[col], col
    assert row["latency_ms_p10"] <= row["latency_ms_p90"]
    # every round (more where the shape was re-timed for a neighbour's spoiled round), unless a
    # busy machine spoiled some of its own (re-timed or left out)
    assert row["n_samples"] >= 3 or row["contended_rounds"] > 0
    assert row["latency_ms_ci_low"] <= row["latency_ms_median"] <= row["latency_ms_ci_high"]
    assert row["speedup_ci_low"] <= row["speedup"] <= row["speedup_ci_high"]


@pytest.mark.parametrize(
    "name,options,backend,kernel,materialized",
    [
        ("fused", {"attention": "sdpa"}, "auto", "cpu_flash", False),
        ("fused", {"attention": "sdpa"}, "flash", "cpu_flash", False),
        ("fused", {"attention": "sdpa"}, "math", "math", True),
        ("fused", {"attention": "manual"}, "auto", "none", True),
        ("separate", {"attention": "sdpa"}, "auto", "cpu_flash", False),
    ],
)
def test_probe_records_the_kernel_and_whether_scores_were_materialized(
    name, options, backend, kernel, materialized
):
    if torch.cuda.is_available():
        pytest.skip("expected kernels are the CPU ones")
    row = run_point(point(name, options=options, sdpa_backend=backend, seq_len=128))
    assert row["status"] == "ok", row
    assert (row["sdpa_kernel"], row["scores_materialized"]) == (kernel, materialized)
    assert row["peak_mem_mb"] > 0


def test_manual_attention_memory_grows_with_the_score_matrix():
    small, big = (run_point(point(options={"attention": "manual"}, seq_len=L)) for L in (128, 512))
    flash = run_point(point(options={"attention": "sdpa"}, seq_len=512))
    assert big["peak_mem_mb"] > 4 * small["peak_mem_mb"]  # L^2 term: (512/128)^2 = 16x for scores
    assert big["peak_mem_mb"] > 2 * flash["peak_mem_mb"]


def test_pinned_backend_that_cannot_run_is_unsupported():
    if torch.cuda.is_available():
        pytest.skip("CUDA has the efficient backend")
    row = run_point(point(sdpa_backend="efficient"))
    assert row["status"] == "unsupported" and "backend" in row["error"]


def test_the_cpu_times_wall_time_whatever_timing_cuda_graph_says():
    """timing.cuda_graph (true by default) is CUDA's: a CPU point is timed by the host's clock
    (one thread: its CPU time, the wall time beside it; several: the wall clock), with no eager
    column and no launch_bound."""
    for graph, threads in ((True, 1), (False, 1), (True, 2)):
        row = run_point(point(timing={**QUICK, "cuda_graph": graph}, num_threads=threads))
        assert row["status"] == "ok", row
        assert row["timed_by"] == ("cpu" if threads == 1 else "wall"), row
        assert (row.get("wall_ms_median") not in (None, "")) == (threads == 1), row
        assert row.get("eager_ms_median") in (None, "") and row["launch_bound"] is None


@pytest.mark.parametrize(
    "name, model",
    [
        ("NVIDIA H100 80GB HBM3", "H100 SXM"),
        ("NVIDIA H100", "H100 SXM"),
        ("NVIDIA H100 PCIe", "H100 PCIe"),
        ("NVIDIA H100 NVL", "H100 NVL"),
        ("NVIDIA H200", "H200 SXM"),
        ("NVIDIA H200 NVL", "H200 NVL"),
        ("NVIDIA GH200 480GB", "GH200"),
        ("NVIDIA A100-SXM4-80GB", "A100"),
        ("NVIDIA A100-PCIE-40GB", "A100"),
        ("NVIDIA A100 80GB PCIe", "A100"),
        ("NVIDIA L4", "L4"),
        ("NVIDIA L40", "L40"),
        ("NVIDIA L40S", "L40S"),
        ("NVIDIA GeForce RTX 4090", "RTX 4090"),
        ("NVIDIA A10G", "A10G"),
        ("NVIDIA A10", "A10"),
        ("Tesla V100-SXM2-16GB", "V100"),
        ("Tesla T4", "T4"),
        ("NVIDIA GeForce RTX 4090 D", None),  # a different card: no guess
        ("NVIDIA A100-SXM4-40GB MIG 1g.5gb", None),  # a slice: the whole GPU's peak is wrong
        ("NVIDIA H100 80GB HBM3 MIG 3g.40gb", None),
        ("AMD EPYC 7B13", None),
    ],
)
def test_datasheet_matches_whole_names_and_refuses_to_guess(name, model):
    from harness.measure.roofline import datasheet_model

    entry = datasheet_model(name)
    assert (entry[0] if entry else None) == model


def test_datasheet_peaks_by_dtype_and_none_for_a_device_with_fewer_sms():
    assert datasheet_peak("NVIDIA H100 80GB HBM3", "bfloat16") == 989.4
    assert datasheet_peak("NVIDIA H100 PCIe", "float16") == 756.5
    assert datasheet_peak("NVIDIA H200 NVL", "bfloat16") == 835.5  # not the SXM figure
    assert datasheet_peak("NVIDIA L40", "bfloat16") == 181.0  # not the L4's
    assert datasheet_peak("NVIDIA A100-SXM4-80GB", "float32") == 19.5
    assert datasheet_peak("NVIDIA H100 80GB HBM3", "bfloat16", sms=132) == 989.4
    assert datasheet_peak("NVIDIA H100 80GB HBM3", "bfloat16", sms=16) is None  # a MIG slice


# a timed sweep at two dtypes (24 s here; env.json's facts: test_cli.py's torch-free sweep):
# make test-slow and CI run it
@pytest.mark.slow
def test_sweep_writes_env_and_measures_the_peak_once_per_dtype(harness_cli, tmp_path):
    proc = harness_cli(
        "-m", "variant=fused,reference", "dtype=float32,bfloat16", *TINY, "hydra.sweep.dir=sweep"
    )
    assert proc.returncode == 0, proc.stderr
    env = json.loads((tmp_path / "sweep" / "env.json").read_text())
    assert env["torch"] == torch.__version__ and env["python"] and env["cpu_model"]
    peaks = json.loads((tmp_path / "sweep" / "peak.json").read_text())
    assert len(peaks) == 2 and all(p["tflops"] > 0 for p in peaks.values())
    assert proc.stdout.count("measured peak:") == 2  # once per dtype, not once per point
    df = pd.read_csv(tmp_path / "sweep" / "results.csv")
    assert (df["pct_of_peak"] > 0).all() and df["device_name"].notna().all()
    assert (df["torch_version"] == torch.__version__).all()


@CUDA
def test_cuda_events_flush_and_graph():
    base = run_point(point(device="cuda", timing={**QUICK, "cuda_graph": False}))
    graphed = run_point(point(device="cuda"))
    assert base["status"] == graphed["status"] == "ok"
    assert base["timed_by"] == "events" and graphed["timed_by"] == "graph"
    assert graphed["eager_ms_median"] > 0 and graphed["launch_bound"] in (True, False)
    # the replay has no launch gaps: never slower than the eager call beyond noise
    assert graphed["latency_ms_median"] <= graphed["eager_ms_median"] * 1.1


@CUDA
@pytest.mark.parametrize("backend", ["flash", "efficient", "math"])
def test_cuda_sdpa_pin_is_recorded(backend):
    row = run_point(point(device="cuda", dtype="bfloat16", sdpa_backend=backend))
    assert row["status"] in ("ok", "unsupported"), row
    if row["status"] == "ok":
        assert row["sdpa_kernel"] == backend


class FakeGPU:
    """A device that runs queued work in order: a call adds ``work_ms`` of device time; an event
    stamps the device clock where it is reached in the queue. The host's own time (Python's
    launches, ``before``) never moves it while work is queued: what queued timing relies on."""

    def __init__(self, work_ms: float):
        self.device_ms, self.work_ms, self.log, self.syncs = 0.0, work_ms, [], 0

    def call(self):
        self.log.append("call")
        self.device_ms += self.work_ms

    def event(self):
        gpu = self

        class Event:
            def record(self):
                gpu.log.append("record")
                self.at = gpu.device_ms

            def elapsed_time(self, end):
                assert gpu.syncs, "read before the batch was synchronised"
                return end.at - self.at

        return Event()

    def synchronize(self):
        self.log.append("sync")
        self.syncs += 1


def test_the_cuda_sampler_queues_a_batch_and_synchronises_once():
    from harness.measure.timing import _CudaSampler, repetition

    gpu = FakeGPU(work_ms=0.25)
    sample = _CudaSampler(
        gpu.call, "cuda", flush_l2=False, event=gpu.event, synchronize=gpu.synchronize
    )
    times = sample.batch(5, before=lambda: gpu.log.append("before"))
    assert times == [0.25] * 5  # device time per call; `before` is outside the events
    assert gpu.syncs == 1 and gpu.log[-1] == "sync"
    assert gpu.log[:-1] == ["before", "record", "call", "record"] * 5
    assert repetition(sample, calls=7, before=None, warm=True) == 0.25  # a round: one batch
    assert gpu.syncs == 2 and len(sample.pairs) == 8  # events are reused, one pair per call


def test_host_time_per_call_and_launch_bound_are_in_the_row():
    from harness.point import run_point
    from harness.schema import ROW

    row = run_point(
        make_point(
            "fused",
            batch=1,
            seq_len=8,
            embed_dim=16,
            num_heads=2,
            device="cpu",
            timing={"warmup": 0.01, "rounds": 2, "round_time": 0.005},
        )
    )
    assert row["status"] == "ok" and row["host_ms_per_call"] > 0
    launch_bound = next(c for c in ROW if c.name == "launch_bound").compute
    assert launch_bound(row) is None and row["launch_bound"] is None  # a CPU point: no launch gap
    cuda = {**row, "device": "cuda", "timed_by": "graph", "latency_ms_median": 0.2}
    assert launch_bound({**cuda, "eager_ms_median": 0.3}) is True  # the caller waits 1.5x
    assert launch_bound({**cuda, "eager_ms_median": 0.21}) is False
    assert launch_bound({**cuda, "timed_by": "events", "eager_ms_median": 0.3}) is None


def test_gpu_clocks_become_columns_and_throttling_is_flagged(monkeypatch):
    """NVML through a fake pynvml: the readings become the row's clock columns, and a thermal
    slowdown in any repetition flags the point; idle or application clocks do not, nor the power
    cap (a board under load), which has its own column."""
    from harness.measure import clocks

    readings = iter(
        [
            (1980, 650_000, 61, 0x0),
            (1755, 700_000, 67, 0x20),
            (1980, 640_000, 63, 0x1),
            (1830, 700_000, 64, 0x4),
        ]
    )

    class FakeNVML:
        NVML_CLOCK_SM, NVML_TEMPERATURE_GPU = 1, 0

        def __init__(self):
            self.now = None

        def nvmlDeviceGetClockInfo(self, handle, kind):
            self.now = next(readings)
            return self.now[0]

        def nvmlDeviceGetPowerUsage(self, handle):
            return self.now[1]

        def nvmlDeviceGetTemperature(self, handle, kind):
            return self.now[2]

        def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle):
            return self.now[3]

    monkeypatch.setattr(clocks, "nvml", lambda: FakeNVML())
    monkeypatch.setattr(clocks, "_handle", lambda nv, device: "gpu0")
    assert clocks.reader("cpu") is None
    read = clocks.reader("cuda:0")
    got = [read() for _ in range(4)]
    cols = clocks.columns(got)
    assert cols["sm_clock_mhz_min"] == 1755 and cols["sm_clock_mhz_median"] == 1905
    assert cols["power_w_median"] == 675.0 and cols["temp_c_max"] == 67
    assert cols["throttled"] is True and cols["power_capped"] is True
    capped = clocks.columns([g for g in got if g[3] != 0x20])  # idle and the power cap
    assert capped["throttled"] is False and capped["power_capped"] is True
    assert clocks.columns(got[:1])["power_capped"] is False
    assert clocks.columns([]) == {}  # no NVML: no columns


def test_without_nvml_a_cuda_point_has_no_clock_reader(monkeypatch):
    from harness.measure import clocks

    monkeypatch.setattr(clocks, "nvml", lambda: None)
    assert clocks.reader("cuda") is None


@CUDA
def test_cuda_rows_have_queued_device_time_host_time_and_clocks():
    """On a GPU: the real CUDA sampler queues a batch (times for every call, one synchronize),
    the row has host time and launch_bound, and with nvidia-ml-py the clock columns."""
    import importlib.util

    from harness.measure.timing import sampler

    x = torch.randn(256, 256, device="cuda")
    times = sampler(lambda: x @ x, "cuda", flush_l2=True).batch(16)
    assert len(times) == 16 and all(t > 0 for t in times)
    row = run_point(point(device="cuda"))
    assert row["status"] == "ok" and row["host_ms_per_call"] > 0
    assert row["launch_bound"] in (True, False)  # computed when the row is written
    if importlib.util.find_spec("pynvml") is not None:
        assert row["sm_clock_mhz_min"] > 0 and row["throttled"] in (True, False)


# -- memory on a fake CUDA device: the flush buffer, the budget, free memory ------------------
class _Props:
    total_memory = 80 * 2**30
    L2_cache_size = 50 * 2**20
    multi_processor_count = 132


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda's device queries answered for an 80 GiB GPU with 50 MiB of L2; "CUDA" tensors
    made on the CPU and counted."""
    from harness.measure import timing

    made = []
    real_empty = torch.empty

    def empty(*size, device=None, **kw):
        if device is not None and str(device).startswith("cuda"):
            made.append(size)
            device = "cpu"
        return real_empty(*size, device=device, **kw)

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: _Props())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(timing.torch, "empty", empty)
    monkeypatch.setattr(timing, "_FLUSH", {})
    return made


def test_every_sampler_on_a_device_shares_one_l2_flush_buffer(fake_cuda):
    from harness.measure.timing import _CudaSampler

    samplers = [
        _CudaSampler(lambda: None, "cuda", True, event=object, synchronize=lambda: None)
        for _ in range(96)
    ]
    assert len(fake_cuda) == 1 and fake_cuda[0] == (256 * 2**20,)  # do_bench's size, once
    assert all(s.cache is samplers[0].cache for s in samplers)
    assert _CudaSampler(lambda: None, "cuda", False, event=object).cache is None


def test_the_resident_budget_counts_the_flush_buffer(fake_cuda):
    from harness.measure.rounds import budget_bytes

    cuda = point(device="cuda")
    assert budget_bytes(cuda) == 80 * 2**30 / 4 - 256 * 2**20
    unflushed = point(device="cuda", timing={**QUICK, "flush_l2": False})
    assert budget_bytes(unflushed) == 80 * 2**30 / 4


def test_free_cuda_memory_counts_what_the_caching_allocator_can_reuse(monkeypatch):
    from harness.way.footprint import available_bytes

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 * 2**30, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 5 * 2**30)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 2 * 2**30)
    assert available_bytes("cuda:0") == 4 * 2**30  # 1 GiB from the driver + 3 GiB cached


HELD: list = []


class OomInForward(torch.nn.Module):
    """Allocates, then fails as an allocation does; keeps a weak reference to what it held."""

    def __init__(self, embed_dim, num_heads, bias=True):
        super().__init__()
        self.inner = torch.nn.MultiheadAttention(embed_dim, num_heads, bias=bias, batch_first=True)

    def forward(self, *args, **kwargs):
        import weakref

        big = torch.ones(2**20)
        HELD.append(weakref.ref(big))
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 MiB")

    def load_state_dict(self, state, strict=True):
        return self.inner.load_state_dict(state, strict)


def test_a_failed_points_tensors_are_gone_before_its_memory_is_released(monkeypatch):
    """empty_cache inside the except block would run while the traceback still holds the point's
    tensors: nothing would go back to the driver and the next point could be falsely oom."""
    import harness.point
    from harness.api import make_point
    from harness.point import prepare_point

    alive_at_release = []
    monkeypatch.setattr(
        harness.point,
        "release_memory",
        lambda device: alive_at_release.append([r() is not None for r in HELD]),
    )
    HELD.clear()
    record, session = prepare_point(make_point(OomInForward, batch=1, seq_len=8, embed_dim=16))
    assert (record.status, session) == ("oom", None), record.outcome.error
    assert alive_at_release == [[False]]  # released once, with the 4 MiB already freed


def test_sdpa_backends_are_named_from_the_kernels_a_cuda_graph_replay_ran():
    from harness.measure.profiling import backends_from_kernels

    names = {
        "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>": "flash",
        "fmha_cutlassF_bf16_aligned_64x128_rf_sm80(PyTorchMemEffAttention::AttentionKernel)": (
            "efficient"
        ),
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x64_4x1x1": (
            "cudnn"
        ),
    }
    for name, backend in names.items():
        assert backends_from_kernels([name, "ampere_bf16_s16816gemm_bf16_128x128"]) == {backend}
    # GEMMs, softmax, a cuDNN convolution: no SDPA backend
    assert (
        backends_from_kernels(["sm90_xmma_gemm_bf16", "cunn_SoftMaxForward", "cudnn_conv"]) == set()
    )


@pytest.mark.parametrize(
    "pin, kernel, kept",
    [
        ("auto", "flash", None),
        ("flash", "flash", True),
        ("math", "flash", False),  # a compiled graph cached under another pin
        ("cudnn", "cudnn", True),
        ("flash", "none", None),  # manual attention: no SDPA kernel to compare
        ("efficient", "flash+efficient", False),
    ],
)
def test_a_row_whose_sdpa_kernel_is_not_its_pin_is_flagged(pin, kernel, kept):
    from harness.schema import pin_kept

    assert pin_kept(pin, kernel) is kept


@CUDA
@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_compiled_rows_that_replay_cuda_graphs_still_name_their_kernel_and_memory(mode):
    row = run_point(point(device="cuda", dtype="bfloat16", seq_len=256, compile=mode))
    assert row["status"] == "ok", row["error"]
    assert row["sdpa_kernel"] not in ("", "none", None) and row["peak_mem_mb"] > 0, row
    assert row["recompiles"] == 0
