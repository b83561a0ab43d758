"""Two times for every CUDA point, against a fake GPU that waits for the host (tests/fakegpu.py):
the device time of the call replayed from a CUDA graph (no launch gaps), which the ranking, the
effects and the findings use, and the eager call time a Python caller waits; launch_bound by
measurement (eager against device); the re-check of the replay that was timed; the between-run
floor measured from the rounds; no garbage collection inside a repetition."""

from __future__ import annotations

import dataclasses
import gc
import math
import random

import pytest

from harness.measure.figures import timed
import torch

from fakegpu import HostBoundGPU
from harness.way.recheck import Counted, Recheck
from harness.config import CUDA_FLOOR
from harness.factory import make_point
from harness.measure import session as session_mod
from harness.measure import stats, timing
from harness.measure.journal import Journal
from harness.measure.rounds import run_rounds
from harness.report.ranking import rank_shape
from harness.schema import LAUNCH_BOUND, launch_bound

OUT = torch.ones(2, 3)


def cuda_point(name="fused", rounds=6, **timing_keys):
    point = make_point(name, device="cpu")
    return dataclasses.replace(
        point,
        device="cuda",
        timing=dataclasses.replace(point.timing, rounds=rounds, rerun_noise=None, **timing_keys),
    )


@pytest.fixture
def fake_cuda(monkeypatch):
    """Session.prepare on a CUDA point with no GPU: each point's calls run on its own simulated
    GPU (``sims``), and ``capture`` says what a CUDA graph capture does."""
    state = {"sim": None, "capture": None}

    def sampler(fn, device, flush):
        s = timing._CudaSampler(
            fn,
            "cuda",
            flush_l2=False,
            event=state["sim"].event,
            synchronize=state["sim"].synchronize,
            clock=state["sim"].clock,
        )
        s.cache = state["sim"] if flush else None  # the L2 flush queued before each call
        return s

    def cuda_graph(call, before, memory=None, device="cuda"):
        if state["capture"] is not None:
            raise state["capture"]
        sim = state["sim"]

        def replay():
            sim.replay()
            return OUT, None

        replay.nbytes = 0
        return replay

    monkeypatch.setattr(session_mod, "use_device", lambda device: None)
    monkeypatch.setattr(session_mod, "sampler", sampler)
    monkeypatch.setattr(session_mod, "cuda_graph", cuda_graph)
    monkeypatch.setattr(session_mod.clocks, "reader", lambda device: None)
    monkeypatch.setattr(
        session_mod.torch.cuda, "synchronize", lambda *a: state["sim"].synchronize()
    )
    monkeypatch.setattr(session_mod.torch.cuda, "memory_reserved", lambda *a: 0)
    return state


def prepared(state, sim, point, reference=False, calls=6):
    state["sim"] = sim

    def call():
        sim.call()
        return OUT, None

    session = session_mod.Session(point, call, None, 0, finish=None, reference=reference)
    session.prepare()
    # the simulated GPU's time is not the machine's: what other processes do here must not
    # spoil its repetitions (under load 18 the ranking found no winner: issue 72)
    session.probe = None
    session.capture()  # as the pool does when it takes the point
    # the simulated calls take no real time: fixed calls per repetition
    session.calls, session.warm, session.eager_calls, session.eager_warm = (
        calls,
        False,
        calls,
        False,
    )
    return session


def test_a_captured_call_keeps_the_eager_call_beside_it(fake_cuda):
    s = prepared(fake_cuda, HostBoundGPU(0.2, 0.04), cuda_point())
    assert s.timed_by == "graph" and s.replay is not None and s.eager_sample is not None
    assert s.graph_error is None


@pytest.mark.parametrize(
    "case, said",
    [
        (
            "refused",
            "not captured in a CUDA graph: RuntimeError: operation not permitted when stream is "
            "capturing",
        ),
        ("off", "timing.cuda_graph=false"),
        ("reduce-overhead", "compile=reduce-overhead replays CUDA graphs of its own"),
    ],
)
def test_a_call_that_is_not_captured_keeps_its_event_timing_and_says_why(fake_cuda, case, said):
    point = cuda_point(cuda_graph=case != "off")
    if case == "refused":
        fake_cuda["capture"] = RuntimeError("operation not permitted when stream is capturing")
    if case == "reduce-overhead":
        point = dataclasses.replace(point, compile="reduce-overhead")
    s = prepared(fake_cuda, HostBoundGPU(0.2, 0.04), point)
    assert s.timed_by == "events" and s.replay is None and s.eager_sample is None
    assert s.graph_error == said
    for r in range(3):
        s.repeat(r, "run")
    cols = timed(s, None).columns()
    assert cols["timed_by"] == "events" and cols["graph_error"] == said
    assert cols["eager_ms_median"] is None and launch_bound(cols) is None


def shape_rows(fake_cuda, ways: dict, rounds=6, refused=()) -> dict:
    """Time ``ways`` ({name: (launch_ms, gpu_ms)}, "reference" among them) in interleaved
    rounds on their fake GPUs; their rows' timing columns by name. The ways in ``refused`` fail
    their graph capture (timed between events)."""
    rows, sessions = {}, []
    for name, (launch, gpu) in ways.items():
        failed = RuntimeError("operation not permitted when stream is capturing")
        fake_cuda["capture"] = failed if name in refused else None
        s = prepared(
            fake_cuda,
            HostBoundGPU(launch, gpu),
            cuda_point("reference" if name == "reference" else "fused", rounds),
            reference=name == "reference",
        )
        s.finish = lambda got, failure, name=name: rows.__setitem__(
            name, {**got.columns(), "label": name, "status": "ok", "device": "cuda"}
        )
        sessions.append(s)
    run_rounds(sessions, say=lambda line: None)
    return rows


def test_device_time_differs_from_eager_time_and_the_ranking_uses_the_device_time(fake_cuda):
    """At one shape: way A needs 40 us of GPU work but 200 us of Python to launch it; way B
    needs 90 us of GPU work launched in 60 us. A Python caller waits less for B; the GPU, which
    is what a CUDA graph or a larger model keeps busy, runs A faster. Device time ranks A first;
    the eager figures stay in their own columns."""
    rows = shape_rows(
        fake_cuda, {"reference": (0.300, 0.200), "A": (0.200, 0.040), "B": (0.060, 0.090)}
    )
    a, b = rows["A"], rows["B"]
    assert a["timed_by"] == b["timed_by"] == "graph"
    assert a["latency_ms_median"] == pytest.approx(0.040, rel=0.02)  # no launch gaps
    assert a["eager_ms_median"] > 4 * a["latency_ms_median"]  # Python's pace, gaps included
    assert b["eager_ms_median"] == pytest.approx(b["latency_ms_median"], rel=0.15)
    assert a["speedup"] > b["speedup"] and a["eager_speedup"] < b["eager_speedup"]
    assert launch_bound(a) is True and launch_bound(b) is False
    assert rank_shape(list(rows.values()))["winner"] == "A"


def test_a_reference_timed_between_events_is_paired_eager_with_eager(fake_cuda):
    """nn.MHA's capture fails (its timed figure is its eager call, between events) while way A
    replays a graph (its timed figure is device time): A's speedup is not nn.MHA's eager time
    over A's device time (about 7x here, none of it A's) but empty, and its eager speedup pairs the
    two eager calls (issue 56)."""
    rows = shape_rows(
        fake_cuda, {"reference": (0.300, 0.200), "A": (0.200, 0.040)}, refused={"reference"}
    )
    ref, a = rows["reference"], rows["A"]
    assert ref["timed_by"] == "events" and a["timed_by"] == "graph"
    assert a["speedup"] is None  # a device time against an eager call time: not paired
    eager = ref["latency_ms_median"] / a["eager_ms_median"]
    assert a["eager_speedup"] == pytest.approx(eager, rel=0.1) and a["eager_speedup"] < 2
    assert a["noise"] is not None  # the latency's, as for a row with no speedup


def test_launch_bound_flips_at_the_stated_ratio(fake_cuda):
    """GPU work of 300 us launched in 0.3x to 2x of it: launch-bound once a Python caller waits
    LAUNCH_BOUND x the device time."""
    flags, ratios = [], []
    for r in (0.3, 0.6, 1.5, 2.0):
        row = shape_rows(fake_cuda, {"reference": (r * 0.3, 0.3)})["reference"]
        ratios.append(row["eager_ms_median"] / row["latency_ms_median"])
        flags.append(launch_bound(row))
    assert flags == [False, False, True, True] and LAUNCH_BOUND == 1.25
    assert ratios[0] == pytest.approx(1.0, abs=0.05)


def test_launch_bound_compares_the_eager_call_with_the_replay_taken_like_it(fake_cuda):
    """An L2-resident decode paced by Python (issue 56): 30 us of GPU work with its data in the
    L2, 20 us more after a flush, launched in 50 us. The eager call (the L2 as the previous call
    left it) waits for Python: 1.7x the warm replay; against the flushed replay (what the device
    time measures) it read 1.0x, GPU-bound. Like for like, it is launch-bound."""
    rows, sessions = {}, []
    fake_cuda["capture"] = None
    s = prepared(
        fake_cuda, HostBoundGPU(0.050, 0.030, cold_ms=0.020), cuda_point("reference"), True
    )
    s.finish = lambda got, failure: rows.__setitem__("ref", {**got.columns(), "status": "ok"})
    sessions.append(s)
    run_rounds(sessions, say=lambda line: None)
    row = rows["ref"]
    assert row["latency_ms_median"] == pytest.approx(0.050, rel=0.05)  # flushed: cold L2
    assert row["replay_warm_ms_median"] == pytest.approx(0.030, rel=0.05)
    assert row["eager_ms_median"] / row["latency_ms_median"] < LAUNCH_BOUND  # the old rule
    assert launch_bound(row) is True
    # without the flush the device time is the warm replay: nothing more is timed
    s = prepared(
        fake_cuda,
        HostBoundGPU(0.050, 0.030, cold_ms=0.020),
        cuda_point("reference", flush_l2=False),
        True,
    )
    assert s.warm_sample is None


def test_the_rounds_may_only_widen_the_floor_a_device_kind_earned(fake_cuda, monkeypatch):
    """Deterministic rounds (a steady GPU) measure a floor of 0: it does not narrow the floor
    earned from re-runs (here none for CUDA: the assumed one, said in the row); a shape whose
    rounds drift more than that gets the drift (``rounds``)."""
    from harness import floors

    monkeypatch.setattr(floors, "earned", lambda kind, path=None: None)
    row = shape_rows(fake_cuda, {"reference": (0.05, 0.3), "A": (0.05, 0.2)})["A"]
    assert row["rerun_noise_from"] == "assumed" and row["rerun_noise"] == CUDA_FLOOR
    earned = floors.Floor(0.005, "2026-11-26", "a steady GPU", "make gpu-check STEP=stability")
    monkeypatch.setattr(floors, "earned", lambda kind, path=None: earned)
    row = shape_rows(fake_cuda, {"reference": (0.05, 0.3), "A": (0.05, 0.2)})["A"]
    assert row["rerun_noise_from"] == "earned" and row["rerun_noise"] == 0.005
    assert row["speedup_ci_high"] / row["speedup_ci_low"] < 1.03


def test_drift_between_the_halves_of_the_rounds_becomes_the_floor():
    rng = random.Random(1)
    steady = [[1.0 + rng.gauss(0, 0.003) for _ in range(11)] for _ in range(5)]
    assert stats.drift_floor(steady) < 0.003
    # every point 10% slower in the second half of the run: an offset a re-run may see too
    drifted = [[v * (1.1 if i >= 6 else 1.0) for i, v in enumerate(s)] for s in steady]
    assert stats.drift_floor(drifted) == pytest.approx(math.log(1.1) / math.sqrt(2), rel=0.1)
    assert stats.drift_floor(steady[:1]) is None  # one point: not measured
    assert stats.drift_floor([s[:3] for s in steady]) is None  # 3 rounds: not measured


def test_a_configured_floor_is_kept_and_null_is_the_earned_one():
    def cols(**timing):
        point = make_point("fused", device="cpu", timing=timing)
        s = session_mod.Session(point, call=lambda: None, before=None, nbytes=0, finish=None)
        s.samples = [session_mod.Sample(r, 0.0, 1.0 + r / 100, "run") for r in range(4)]
        return timed(s, None, floor=0.0).columns()

    set_ = cols(rerun_noise=0.03)
    assert set_["rerun_noise_from"] == "config" and set_["rerun_noise"] == 0.03
    from harness import floors

    cpu = floors.earned("cpu")
    null = cols()
    if cpu is None:
        assert null["rerun_noise_from"] == "assumed"
    else:  # harness/floors.json's, with its date and machine
        assert null["rerun_noise_from"] == "earned" and null["rerun_noise"] == cpu.value


def recheck_session(replay_out):
    s = session_mod.Session(
        make_point("fused", device="cpu"),
        call=Counted(lambda: (OUT.clone(), None)),
        before=None,
        nbytes=0,
        finish=None,
        recheck=Recheck(OUT.clone(), 1e-6, "cpu"),
    )
    s.replay = lambda: (replay_out, None)
    return s


def test_the_recheck_runs_the_replay_that_was_timed():
    """A graph that did not capture part of the call (work on the host) replays another output
    than the eager call gives: the row is a mismatch that says so."""
    wrong = recheck_session(torch.zeros(2, 3))
    wrong.run_recheck()
    assert wrong.changed and "CUDA graph replay" in wrong.changed
    right = recheck_session(OUT.clone())
    right.run_recheck()
    assert right.changed is None


def test_no_garbage_collection_inside_a_repetition():
    seen = []
    s = session_mod.Session(
        make_point("fused", device="cpu"),
        call=lambda: seen.append(gc.isenabled()),
        before=None,
        nbytes=0,
        finish=None,
    )
    s.sample = timing._CpuSampler(s.call)
    s.calls, s.warm = 3, False
    assert gc.isenabled()
    s.repeat(0, "run")
    assert seen == [False, False, False] and gc.isenabled()


def test_the_journal_keeps_the_eager_time_and_the_warm_replay(tmp_path):
    journal = Journal(tmp_path / "rounds.jsonl")
    journal.append("k", session_mod.Sample(0, 1.0, 0.04, "run", eager_ms=0.2, warm_ms=0.03))
    journal.append("k", session_mod.Sample(1, 2.0, 0.05, "run"))
    journal.close()
    loaded = Journal(tmp_path / "rounds.jsonl").load("k")
    assert [x.eager_ms for x in loaded] == [0.2, None]
    assert [x.warm_ms for x in loaded] == [0.03, None]
