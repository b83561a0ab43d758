"""The CUDA timing paths against a fake GPU that waits for the host: the enqueue time, a graph's
memory pool in the memory budget, a point's warm-up on its own GPU, NVML's clocks (device time
against eager time and launch_bound: tests/test_device_time.py). No GPU needed; `make gpu-check`
shows the same on a real one (docs/measurements.md)."""

from __future__ import annotations

import dataclasses

import pytest

from harness.measure.figures import timed

from harness.measure import timing
from harness.measure import session as session_mod
from harness.factory import make_point
from fakegpu import HostBoundGPU


def test_the_first_slow_enqueue_after_a_synchronize_does_not_count():
    """On an H100 the first call after a synchronize enqueued in 0.25-0.5 ms, the next ones in
    0.11-0.15 ms: the least of the first calls is Python's launch time."""
    sim = HostBoundGPU(launch_ms=0.120, gpu_ms=0.400)
    sample = sim.sampler()
    fn, calls = sim.call, {"n": 0}

    def slow_first():
        calls["n"] += 1
        if calls["n"] == 1:
            sim.host += 0.4
        fn()

    sample.fn = slow_first
    sample.batch(8)
    assert sample.launch_ms == pytest.approx(0.124, rel=0.05)


def test_the_launch_time_is_read_before_the_launch_queue_fills():
    """Later calls of a GPU-bound batch block in a full queue (enqueue time = the GPU's pace):
    only the first LAUNCH_CALLS calls count."""
    sim = HostBoundGPU(launch_ms=0.010, gpu_ms=0.500)
    sample = sim.sampler()
    fn = sim.call
    calls = {"n": 0}

    def blocking_after_a_few():
        calls["n"] += 1
        if calls["n"] > timing.LAUNCH_CALLS:  # the queue is full: wait for the GPU
            sim.host = max(sim.host, sim.gpu - 0.5)
        fn()

    sample.fn = blocking_after_a_few
    sample.batch(50)
    assert sample.launch_ms == pytest.approx(0.014, rel=0.1)


def test_a_rounds_row_carries_the_launch_time_and_the_cpu_has_none():
    from harness.point import run_point

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
    assert row["status"] == "ok" and row["launch_ms_per_call"] in (None, "")
    assert row["launch_bound"] is None

    session = session_mod.Session(
        make_point("fused", device="cpu"), call=lambda: None, before=None, nbytes=0, finish=None
    )
    session.sample = HostBoundGPU(launch_ms=0.2, gpu_ms=0.04).sampler()
    session.calls, session.warm = 5, False
    for r in range(3):
        session.repeat(r, "run")
    assert timed(session, None).columns()["launch_ms_per_call"] == pytest.approx(0.204, rel=0.05)


@pytest.fixture
def fake_cuda_prepare(monkeypatch):
    """Session.prepare on a 'cuda:1' point without a GPU: what it asks of torch.cuda recorded."""
    log = {"current": [], "reserved": 0, "calls": []}

    def use_device(device):
        log["current"].append(device)

    def graph(fn, before=None, memory=None, device="cuda"):  # its pool: what it reserved
        log["reserved"] += 300 * 2**20
        log["current"].append(device)

        def replay():
            return fn()

        replay.nbytes = 300 * 2**20
        return replay

    monkeypatch.setattr(session_mod, "use_device", use_device)
    monkeypatch.setattr(session_mod, "cuda_graph", graph)

    def synchronize(*args):
        log["calls"].append("sync")

    monkeypatch.setattr(session_mod.torch.cuda, "synchronize", synchronize)
    monkeypatch.setattr(session_mod.torch.cuda, "memory_reserved", lambda *a: log["reserved"])
    monkeypatch.setattr(session_mod, "sampler", lambda fn, device, flush: lambda: 0.0)
    monkeypatch.setattr(session_mod.clocks, "reader", lambda device: None)
    return log


def cuda_session(graph: bool, log) -> session_mod.Session:
    point = make_point("fused", device="cpu")
    point = dataclasses.replace(
        point, device="cuda:1", timing=dataclasses.replace(point.timing, cuda_graph=graph)
    )

    def call():
        log["calls"].append(("call", log["current"][-1] if log["current"] else None))

    return session_mod.Session(point, call, None, nbytes=1000, finish=None)


def test_a_graphs_memory_pool_counts_in_what_a_waiting_point_holds(fake_cuda_prepare):
    """timing.cuda_graph=true: the graph's pool stays reserved while the point waits for its
    rounds; the pool's budget (Pool.add) must see it."""
    graphed = cuda_session(True, fake_cuda_prepare).prepare()
    graphed.capture()
    assert graphed.nbytes == 1000 + 300 * 2**20
    plain = cuda_session(False, fake_cuda_prepare).prepare()
    plain.capture()
    assert plain.nbytes == 1000


def test_warm_up_runs_on_the_points_own_gpu(fake_cuda_prepare):
    """A reference built for pairing at a cuda:1 shape warms up (and synchronises) with cuda:1
    current, whatever point ran before it."""
    fake_cuda_prepare["current"].append("cuda:0")  # the GPU the previous point left current
    cuda_session(False, fake_cuda_prepare).prepare()
    calls = [c for c in fake_cuda_prepare["calls"] if c != "sync"]
    assert calls and all(device == "cuda:1" for _, device in calls)
