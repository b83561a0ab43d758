"""The CPU clock (docs/methodology.md, "The clock"): with one thread on the CPU the timed thread's
CPU time decides, so a busy machine's waits are not in the figures and its repetitions are not
spoiled for them; the wall time stays beside it. A played machine for the rules (no timed
assertions), real calls for what the clock reads."""

import threading
import time

import pytest

from harness.factory import make_point
from harness.measure import contention
from harness.measure.journal import Journal, Sample
from harness.measure.rounds import run_rounds
from harness.measure.session import Session
from harness.measure.timing import cpu_figures, sampler
from tests.test_contention import Played


def test_the_cpu_clock_reads_the_threads_work_not_its_waits():
    """A call that sleeps 20 ms waits 20 ms of wall time and uses almost no CPU time: what the
    scheduler or a sleep takes is not the way's cost."""
    timer = sampler(lambda: time.sleep(0.02), "cpu", False)
    wall = timer.batch(3)
    cpu, others = cpu_figures(timer, warm=False)
    assert min(wall) >= 19.0, wall
    assert cpu is not None and cpu < 5.0, (cpu, wall)
    assert len(timer.cpu_times) == 3


def test_work_done_by_the_processs_other_threads_is_seen():
    """A thread left spinning beside the calls (a variant's, say) uses CPU time that is not the
    timed thread's: the sampler says how much, and the session spoils such a repetition."""
    from harness.measure.session import _other_threads

    stop = threading.Event()

    def spin():
        while not stop.is_set():
            pass

    worker = threading.Thread(target=spin, daemon=True)
    worker.start()
    try:
        timer = sampler(lambda: time.sleep(0.1), "cpu", False)
        timer.batch(3)
    finally:
        stop.set()
        worker.join()
    cpu, others = cpu_figures(timer, warm=False)
    # it ran while the calls slept (the GIL released): 300 ms of it, a few ms at least on a
    # machine at load 20 (no bound that needs the machine idle)
    assert others > 1.0, (cpu, others)
    said = _other_threads(others, cpu * 3)
    assert said is not None and said.startswith("other threads of this process used"), said
    assert _other_threads(0.1, 50.0) is None
    seen = contention.Seen(0.0, 0.0, 0.0, 1.0, 1.0, None, None)
    assert contention.words([seen], 2, [said]).startswith(
        "other threads of this process worked beside the calls in 1"
    )


def test_with_the_cpu_clock_a_wait_for_a_cpu_spoils_nothing_and_steal_only_where_charged(
    monkeypatch, tmp_path
):
    m = Played()
    m.busy = True
    seen = contention.between(m.probe().read(), m.probe().read())
    assert seen.spoiled(1, 2) is not None  # the wall clock: its threads waited
    assert seen.spoiled(1, 2, clock="cpu") is None
    stolen = contention.Seen(0.0, 0.0, 0.5, 0.5, 10.0, 3.0, None)
    assert stolen.spoiled(1, 2) == "the hypervisor took 0.50 cores"
    monkeypatch.setattr(contention, "steal_in_cpu_time", lambda: True)
    assert stolen.spoiled(1, 2, clock="cpu") == "the hypervisor took 0.50 cores"
    monkeypatch.setattr(contention, "steal_in_cpu_time", lambda: False)
    assert stolen.spoiled(1, 2, clock="cpu") is None
    monkeypatch.undo()
    # the kernel's word for it: its config, where it can be read
    guest = tmp_path / "config"
    guest.write_text("CONFIG_PARAVIRT=y\nCONFIG_PARAVIRT_TIME_ACCOUNTING=y\n")
    other = tmp_path / "config-other"
    other.write_text("# CONFIG_PARAVIRT_TIME_ACCOUNTING is not set\n")
    assert contention.steal_in_cpu_time((str(guest),)) is False
    assert contention.steal_in_cpu_time((str(other),)) is True
    assert contention.steal_in_cpu_time((str(tmp_path / "none"),)) is True  # unknown: charged


class CpuTimer:
    """A played CPU sampler: each call is ``ms`` of the thread's work; while the machine is busy
    its wall time is three times that (the scheduler gave the rest to others)."""

    def __init__(self, machine: Played, ms: float):
        self.machine, self.ms = machine, ms
        self.cpu_times, self.others_ms = [], 0.0

    def batch(self, calls, before=None):
        self.cpu_times = [self.ms] * calls
        return [self.ms * (3 if self.machine.busy else 1)] * calls

    def __call__(self):
        return self.batch(1)[0]


TINY = dict(
    batch=1, seq_len=8, embed_dim=16, num_heads=2, device="cpu", num_threads=1,
    timing=dict(warmup=0, rounds=7, round_time=0.001),
)  # fmt: skip


def played_session(machine, name, ms, done, reference=False, clock="cpu"):
    p = make_point("reference" if reference else "fused", **TINY)
    s = Session(
        p,
        call=lambda: None,
        before=None,
        nbytes=1000,
        finish=lambda got, failure: done.append((name, got and got.columns(), failure)),
        reference=reference,
    )
    s.sample, s.calls, s.warm, s.timed_by = CpuTimer(machine, ms), 1, False, clock
    s.probe = machine.probe()
    return s


def test_a_busy_machine_leaves_cpu_clock_points_decided_and_the_wall_time_beside_them():
    """The same played machine that leaves wall-clock points contended (test_contention.py):
    with the CPU clock every round is clean, the speedup is the quiet machine's, exactly, and
    the row says which clock decided and what the wall clock read."""
    m, done, said = Played(), [], []
    sessions = [
        played_session(m, "ref", 2.0, done, reference=True),
        played_session(m, "fast", 1.0, done),
    ]
    m.busy = True
    run_rounds(sessions, say=said.append)
    cols = {name: c for name, c, _ in done}
    fast = cols["fast"]
    assert fast["contended"] is False and fast["contended_rounds"] == 0, fast
    assert fast["timed_by"] == "cpu" and fast["n_samples"] == 7
    assert fast["speedup"] == pytest.approx(2.0, rel=1e-6)
    assert fast["latency_ms_median"] == pytest.approx(1.0, rel=1e-6)
    assert fast["wall_ms_median"] == pytest.approx(3.0, rel=1e-6)
    assert fast["cpu_wait"] == pytest.approx(0.5)  # what the machine did is still said
    assert not any(line.startswith("re-timing round") for line in said), said

    # the same machine timed by the wall clock: contended, as before
    m, done = Played(), []
    sessions = [
        played_session(m, "ref", 2.0, done, reference=True, clock="wall"),
        played_session(m, "fast", 1.0, done, clock="wall"),
    ]
    m.busy = True
    run_rounds(sessions, say=lambda line: None)
    fast = {name: c for name, c, _ in done}["fast"]
    assert fast["contended"] is True and fast["timed_by"] == "wall"
    assert fast["wall_ms_median"] is None


def test_a_resumed_point_without_cpu_times_is_timed_by_the_wall_clock(tmp_path):
    """Repetitions journaled before the CPU clock have no ``cpu_ms``: such a point's figures
    come from the wall time, said so, and it still pairs with its reference on the wall time."""
    journal = Journal(tmp_path / "rounds.jsonl")
    journal.append("k", Sample(0, 1.0, 2.0, "run", cpu_ms=1.9))
    journal.append("k", Sample(1, 2.0, 2.1, "run"))
    back = journal.load("k")
    assert [x.cpu_ms for x in back] == [1.9, None]
    m, done = Played(), []
    ref = played_session(m, "ref", 2.0, done, reference=True)
    old = played_session(m, "old", 1.0, done)
    old.samples = [Sample(r, 0.0, 1.0, "old-run") for r in range(3)]
    assert old.method() == ("wall", "ms") and ref.method() == ("cpu", "cpu_ms")
    ref.samples = [Sample(r, 0.0, 2.0, "old-run", cpu_ms=2.0) for r in range(3)]
    from harness.measure.figures import timed

    got = timed(old, ref).columns()
    assert got["timed_by"] == "wall" and got["speedup"] == pytest.approx(2.0, rel=1e-6)


def test_the_report_says_which_clock_timed_the_cpu_rows():
    import pandas as pd

    from harness.report.render import threads_note

    rows = pd.DataFrame([{"device": "cpu", "num_threads": 1, "cores": 2, "timed_by": "cpu"}])
    assert "by the timed thread's CPU time: a busy machine's waits" in threads_note(rows)
    both = pd.concat([rows, rows.assign(num_threads=2, timed_by="wall")])
    assert "where one thread ran (the wall clock elsewhere)" in threads_note(both)
    assert "CPU time" not in threads_note(rows.assign(timed_by="wall"))


def test_a_busy_run_timed_by_the_cpu_clock_says_its_waits_are_left_out_of_its_figures():
    import pandas as pd

    from harness.report.busy import busy_line

    row = dict(
        variant="fused", label="fused", status="ok", latency_ms_median=1.0, busy_cores=1.5,
        cores=2, cpu_wait=0.49, contended=False, contended_rounds=0, timed_by="cpu",
        batch=1, seq_len=8, embed_dim=16, num_heads=2, dtype="float32", device="cpu",
    )  # fmt: skip
    said = busy_line(pd.DataFrame([row]))
    assert "its threads waited for a CPU 49% of the time, which the figures leave out" in said
    assert said.endswith("so the figures stand.")
    wall = busy_line(pd.DataFrame([dict(row, timed_by="wall", cpu_wait=0.0)]))
    assert "no repetition waited for a CPU" in wall


def test_a_call_that_blocks_is_timed_by_the_wall_clock():
    """A call off the CPU without waiting for one (a sleep, I/O, another process) would read
    fast by its CPU time: the sampler measures the share, ``measure`` and the rounds then time
    it by the wall clock."""
    import torch

    from harness.measure.timing import BLOCKED, Window, measure

    timer = sampler(lambda: time.sleep(0.01), "cpu", False)
    timer.batch(3)
    assert timer.blocked > 0.5, timer.blocked
    # a call at work reads far less blocked: below the rule's share on a quiet machine; under
    # load (the hypervisor's steal is no run-queue wait) 0.49 was seen, so against the sleep's,
    # the least of three batches
    busy = sampler(lambda: sum(range(200000)), "cpu", False)  # a few ms a call
    shares = []
    for _ in range(3):
        busy.batch(5)
        shares.append(busy.blocked)
    assert min(shares) < max(BLOCKED, timer.blocked - 0.25), (shares, timer.blocked)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        slept = measure(lambda: time.sleep(0.002), "cpu", Window(warmup=0, min_samples=5,
                                                                min_time=0, max_time=0.03))
    finally:
        torch.set_num_threads(threads)
    assert slept.median_ms >= 2.0


def test_a_point_whose_calls_block_is_decided_by_the_wall_clock_in_the_rounds():
    m, done = Played(), []
    sessions = [
        played_session(m, "ref", 2.0, done, reference=True),
        played_session(m, "sleepy", 1.0, done),
    ]
    sessions[1].sample.blocked = 0.6  # off the CPU, not waiting for one, most of each call
    run_rounds(sessions, say=lambda line: None)
    cols = {name: c for name, c, _ in done}
    assert cols["sleepy"]["timed_by"] == "wall" and cols["ref"]["timed_by"] == "cpu"
    assert cols["sleepy"]["speedup"] == pytest.approx(2.0, rel=1e-6)  # wall against wall
