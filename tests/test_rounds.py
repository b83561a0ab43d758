"""Measurement you can act on: intervals, interleaved rounds, rankings, A/B verdicts and report
honesty, tested on synthetic samples where the truth is known (no timed assertions)."""

import itertools
import math
import random
import statistics

import pytest

from harness.measure import contention, stats
from harness.measure.journal import Journal, Sample
from harness.measure.rounds import Pool, Session, reference_key, run_rounds
from harness.factory import make_point


@pytest.fixture(autouse=True)
def quiet_machine(monkeypatch):
    """These tests play the machine (``Machine``): a reference the rounds build for pairing is
    prepared for real, and on a busy test machine its real contention probe would spoil its
    rounds. Contention has tests of its own (tests/test_contention.py, test_busy_verdicts.py)."""
    monkeypatch.setattr(contention, "Probe", lambda *a, **k: None)


TINY = dict(
    batch=1,
    seq_len=8,
    embed_dim=16,
    num_heads=2,
    device="cpu",
    timing=dict(warmup=0, rounds=7, round_time=0.001),
)


# --- statistics on synthetic samples ---------------------------------------------------------


def test_t_quantiles():
    assert stats.t975(1) == pytest.approx(12.706) and stats.t975(10) == pytest.approx(2.228)
    assert stats.t975(31) == pytest.approx(2.040, abs=0.002)  # the approximation joins the table
    assert stats.t975(10_000) == pytest.approx(1.960, abs=0.001)
    assert stats.t975(0) == math.inf


def test_interval_covers_the_truth_95_percent_of_the_time():
    rng = random.Random(0)
    hits = 0
    for _ in range(2000):
        values = [5.0 * math.exp(rng.gauss(0, 0.1)) for _ in range(11)]
        iv = stats.log_interval(values)
        hits += iv.low <= 5.0 <= iv.high
    assert 0.93 <= hits / 2000 <= 0.97


def test_interval_needs_two_values_and_ignores_junk():
    one = stats.log_interval([2.0])
    assert one.center == 2.0 and math.isnan(one.low) and one.rel_halfwidth == math.inf
    assert stats.log_interval([]).n == 0
    assert (
        stats.log_interval([1.0, 1.0, float("nan"), 0.0, -1.0]).n == 2
    )  # non-positive and NaN dropped
    assert stats.log_interval([3.0] * 5).rel_halfwidth == 0


def drifting_rounds(
    ratio: float, rounds: int = 11, drift: float = 0.3, noise: float = 0.03, seed: int = 0
):
    """Reference and way times of a machine that slows by ``drift`` over the sweep."""
    rng = random.Random(seed)
    ref, way = [], []
    for r in range(rounds):
        machine = 1 + drift * r / (rounds - 1)  # both see the same machine in one round
        ref.append(10.0 * machine * math.exp(rng.gauss(0, noise)))
        way.append(10.0 / ratio * machine * math.exp(rng.gauss(0, noise)))
    return ref, way


def test_pairing_cancels_drift_that_unpaired_latencies_carry():
    ref, way = drifting_rounds(1.25, drift=0.6, noise=0.02)
    paired = stats.paired_ratio(ref, way)
    assert paired.low <= 1.25 <= paired.high and paired.rel_halfwidth < 0.04
    latency = stats.log_interval(way)
    assert (
        latency.rel_halfwidth > 2 * paired.rel_halfwidth
    )  # the drift is inside the latency interval


def test_a_disturbed_round_is_discounted_and_disturbance_throughout_widens_the_interval():
    ref, way = drifting_rounds(1.5, drift=0)
    clean = stats.paired_ratio(ref, way)
    plain = stats.log_interval([a / b for a, b in zip(ref, way)])
    assert clean.center != plain.center  # the trimmed mean, not the plain one
    way[4] *= 3  # a neighbour's burst during one repetition
    hit = stats.paired_ratio(ref, way)
    assert abs(math.log(hit.center / clean.center)) < 0.02  # neither moved ...
    assert hit.rel_halfwidth < 1.5 * clean.rel_halfwidth  # ... nor blown up by one round
    assert hit.low <= 1.5 <= hit.high
    assert stats.log_interval([a / b for a, b in zip(ref, way)]).rel_halfwidth > 3 * (
        clean.rel_halfwidth
    )  # what the plain mean made of it
    for r in (1, 4, 6, 8, 10):  # disturbed in 5 of 11 rounds: more than the trim discounts
        way[r] *= 1.0 if r == 4 else 3
    assert stats.paired_ratio(ref, way).rel_halfwidth > 3 * clean.rel_halfwidth


def test_rounds_interval_is_yuens_trimmed_interval():
    logs = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 5.0]  # n=11: 2 trimmed each end
    iv = stats.rounds_interval([math.exp(x) for x in logs])
    assert math.log(iv.center) == pytest.approx(0.5)  # mean of 0.2 .. 0.8
    winsorized = [0.2, 0.2, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.8, 0.8]
    se = math.sqrt(10 * statistics.variance(winsorized) / (7 * 6))
    assert stats.log_halfwidth(iv.low, iv.high) == pytest.approx(stats.t975(6) * se)
    few = [2.0, 2.2, 2.1, 9.0]  # fewer than 5 rounds: nothing trimmed
    assert stats.rounds_interval(few) == stats.log_interval(few)


def test_trimmed_interval_covers_the_truth_95_percent_of_the_time():
    rng = random.Random(3)
    hits = 0
    for _ in range(2000):
        iv = stats.rounds_interval([5.0 * math.exp(rng.gauss(0, 0.1)) for _ in range(11)])
        hits += iv.low <= 5.0 <= iv.high
    assert 0.93 <= hits / 2000 <= 0.97


def test_ratio_of_two_runs_finds_a_planted_shift_and_passes_none():
    rng = random.Random(1)
    same_hits = shift_hits = 0
    for trial in range(200):
        a = stats.paired_ratio(*drifting_rounds(1.3, seed=rng.randrange(10**6)))
        b = stats.paired_ratio(
            *drifting_rounds(1.3, drift=-0.2, seed=rng.randrange(10**6))
        )  # other drift
        slow = stats.paired_ratio(*drifting_rounds(1.3 / 1.2, seed=rng.randrange(10**6)))
        same = stats.ratio_of_intervals(
            (1 / a.center, 1 / a.high, 1 / a.low), (1 / b.center, 1 / b.high, 1 / b.low)
        )
        shifted = stats.ratio_of_intervals(
            (1 / a.center, 1 / a.high, 1 / a.low), (1 / slow.center, 1 / slow.high, 1 / slow.low)
        )
        same_hits += same.low <= 1 <= same.high
        shift_hits += shifted.low > 1 and shifted.low <= 1.2 <= shifted.high
    assert same_hits >= 190 and shift_hits >= 190


# --- rounds: interleaving, pairing, failures, blocks ------------------------------------------


class Machine:
    """A synthetic sampler: every call is one tick of a clock; the machine slows as it ticks."""

    def __init__(self, drift_per_tick=0.002):
        self.tick = 0
        self.log = []  # (session name, round) in the order repetitions ran
        self.drift = drift_per_tick

    def sampler(self, name, base_ms, fail_at=None):
        def sample():
            self.tick += 1
            if fail_at is not None and self.tick >= fail_at:
                raise RuntimeError("boom")
            return base_ms * (1 + self.drift * self.tick)

        return sample


def session(machine, name, base_ms, seq_len=8, reference=False, done=None, fail_at=None, **timing):
    p = make_point(
        "reference" if reference else "fused",
        **{**TINY, "seq_len": seq_len, "timing": {**TINY["timing"], **timing}},
    )
    s = Session(
        p,
        call=lambda: None,
        before=None,
        nbytes=1000,
        finish=(lambda got, failure: done.append((name, got and got.columns(), failure)))
        if done is not None
        else None,
        reference=reference,
    )
    sample = machine.sampler(name, base_ms, fail_at)

    def logged():
        machine.log.append(name)
        return sample()

    s.sample, s.calls, s.warm = logged, 1, False
    return s


def test_rounds_interleave_every_shape_before_the_next_round_and_pair_with_the_reference():
    m, done = Machine(), []
    sessions = [
        session(m, f"{w}{L}", base, seq_len=L, reference=(w == "ref"), done=done)
        for L in (8, 16, 32)
        for w, base in (("ref", 2.0), ("fast", 1.0), ("slow", 4.0))
    ]
    run_rounds(sessions, say=lambda _: None)
    # Round r visits every point once, and every shape's ways run back to back.
    rounds = [m.log[i : i + 9] for i in range(0, len(m.log), 9)]
    assert len(rounds) == 7 and all(
        sorted(r) == sorted(s_name for s_name, *_ in done) for r in rounds
    )
    for r in rounds:
        shapes = [name.lstrip("refastslow") for name in r]
        assert [k for k, _ in itertools.groupby(shapes)] == list(
            dict.fromkeys(shapes)
        )  # contiguous
    assert len({tuple(r) for r in rounds}) > 1  # the order is shuffled from round to round
    cols = {name: c for name, c, _ in done}
    # The machine drifted ~20% over the run; the paired speedups are still exact.
    assert cols["fast16"]["speedup"] == pytest.approx(2.0, rel=0.01)
    assert cols["slow32"]["speedup"] == pytest.approx(0.5, rel=0.01)
    assert (
        cols["ref8"]["speedup"] == 1.0
        and cols["ref8"]["speedup_ci_low"] == cols["ref8"]["speedup_ci_high"] == 1.0
    )
    lat = cols["fast8"]
    assert (
        lat["n_samples"] == 7
        and lat["latency_ms_ci_low"] < lat["latency_ms_median"] < lat["latency_ms_ci_high"]
    )
    # Noise-free pairs: the interval is the between-run term alone, 1.96 * the earned floor.
    from harness.config import rerun_floor

    assert lat["rerun_noise_from"] in ("earned", "assumed")
    floor = rerun_floor("cpu")[0]
    assert lat["noise"] == pytest.approx(stats.Z975 * floor, rel=0.02) and lat["noise_target_met"]
    assert lat["rounds_span_s"] > 0


def test_a_shape_without_its_reference_gets_one_built_for_pairing():
    m, done = Machine(), []
    run_rounds([session(m, "way", 1.0, done=done)], say=lambda _: None)
    ((name, cols, failure),) = done
    assert failure is None and cols["speedup"] > 0 and cols["speedup_ci_low"] <= cols["speedup"]


def test_a_point_that_fails_in_its_rounds_is_recorded_and_the_others_finish():
    m, done = Machine(), []
    run_rounds(
        [
            session(m, "ref", 2.0, reference=True, done=done),
            session(m, "ok", 1.0, done=done),
            session(m, "bad", 1.0, done=done, fail_at=6),
        ],
        say=lambda _: None,
    )
    out = {name: (cols, failure) for name, cols, failure in done}
    status, said, trace = out["bad"][1]
    assert status == "error" and said.startswith("RuntimeError: boom (at a timed call: ")
    assert "give it a rewind" in said  # after a passing check: the usual cause
    assert trace.startswith("Traceback (most recent call last)")
    assert 'raise RuntimeError("boom")' in trace
    assert out["ok"][1] is None and out["ok"][0]["n_samples"] == 7


def _journaled(machine, journal, name, base_ms, seq_len=8, reference=False, done=None):
    s = session(machine, name, base_ms, seq_len=seq_len, reference=reference, done=done)
    s.journal, s.journal_key = journal, name
    s.samples = journal.load(name)  # what resume does (harness/point.py); empty the first time
    return s


def test_stopped_rounds_keep_two_or_more_and_resume_runs_only_the_missing_rounds(tmp_path):
    journal = Journal(tmp_path / "rounds.jsonl")
    m, first = Machine(), []
    ways = [("ref", 2.0, True), ("fast", 1.0, False), ("slow", 4.0, False)]
    sessions = [
        _journaled(m, journal, f"{w}{L}", base, seq_len=L, reference=ref, done=first)
        for L in (8, 16)
        for w, base, ref in ways
    ]
    sessions.append(
        _journaled(m, journal, "alone", 1.0, seq_len=32, done=first)
    )  # its reference built for pairing
    visits = []
    with pytest.raises(KeyboardInterrupt):  # stopped a little way into round 3 (index 2)
        run_rounds(
            sessions,
            say=lambda _: None,
            on_visit=lambda s, r: visits.append(r),
            stop=lambda: len(visits) >= 2 * 8 + 3,
        )
    # Stopped: rows for the points with two rounds or more, marked partial, with an interval.
    assert sorted(n for n, *_ in first) == sorted(s.journal_key for s in sessions)
    assert all(
        c["timing_state"] == "partial" and c["n_samples"] in (2, 3) and c["latency_ms_ci_low"] > 0
        for _, c, _ in first
    )
    on_disk = {s.journal_key: journal.load(s.journal_key) for s in sessions}
    assert all(len(v) in (2, 3) for v in on_disk.values())  # every finished repetition, as it ended
    assert len(journal.load(reference_key(sessions[-1].point))) in (
        2,
        3,
    )  # the built reference's too

    # Resume: the same points with what the journal holds; only the missing rounds run.
    m2, done = Machine(), []
    again = [
        _journaled(
            m2,
            journal,
            s.journal_key,
            base,
            seq_len=s.point.seq_len,
            reference=s.reference,
            done=done,
        )
        for s, base in zip(sessions, [2.0, 1.0, 4.0, 2.0, 1.0, 4.0, 1.0])
    ]
    run_rounds(again, say=lambda _: None)
    cols = {name: c for name, c, failure in done if failure is None}
    assert len(cols) == 7 and all(
        c["timing_state"] == "done" and c["n_samples"] == 7 for c in cols.values()
    )

    def missing(kept):
        return set(range(7)) - {x.round for x in kept}

    def paired(
        way, ref
    ):  # a way's repetition counts only with its reference's of the same round and run
        theirs = {(x.run, x.round) for x in on_disk[ref]}
        return [x for x in on_disk[way] if (x.run, x.round) in theirs]

    for L in (8, 16):
        need = {w: missing(paired(f"{w}{L}", f"ref{L}")) for w in ("fast", "slow")}
        for w in ("fast", "slow"):
            assert m2.log.count(f"{w}{L}") == len(need[w])
        # the reference runs where it lacks a round and wherever one of its ways runs
        assert m2.log.count(f"ref{L}") == len(
            missing(on_disk[f"ref{L}"]) | need["fast"] | need["slow"]
        )
    assert (
        m2.log.count("alone") <= 7 - 2
    )  # its reference built for pairing took its repetitions from the journal
    # Pairs never cross runs: the speedups are those of each run's own pairs (drift-free here).
    assert cols["fast8"]["speedup"] == pytest.approx(2.0, rel=0.02)
    assert cols["slow16"]["speedup"] == pytest.approx(0.5, rel=0.02)
    assert cols["alone"]["speedup"] > 0


def test_the_journal_survives_a_line_cut_short_and_a_reset_starts_a_point_afresh(tmp_path):
    path = tmp_path / "rounds.jsonl"
    first = Journal(path)
    for r in range(2):
        first.append("a", Sample(r, 1.0, 2.0, "run1"))
    first.append("b", Sample(0, 1.0, 2.0, "run1"))
    first.close()
    with open(path, "ab") as f:
        f.write(b'{"key":"a","round":2,"at"')  # killed in the middle of a line
    again = Journal(path)
    assert [s.round for s in again.load("a")] == [0, 1]
    again.append("a", Sample(2, 3.0, 4.0, "run2"))  # not swallowed by the cut line
    again.reset("b")  # b runs from the start: its old repetitions no longer count
    assert [(s.round, s.run) for s in again.load("a")] == [(0, "run1"), (1, "run1"), (2, "run2")]
    assert again.load("b") == [] and Journal(path).load("b") == []


def test_memory_budget_times_a_block_at_a_shape_boundary():
    m, done = Machine(), []
    pool = Pool(say=lambda _: None)
    pool.add(session(m, "a1", 1.0, seq_len=8, reference=True, done=done, resident_mb=0))
    pool.add(session(m, "a2", 1.0, seq_len=8, done=done, resident_mb=0))  # same shape: stays
    assert done == []
    pool.add(
        session(m, "b1", 1.0, seq_len=16, reference=True, done=done, resident_mb=0)
    )  # new shape: A is timed
    assert sorted(n for n, *_ in done) == ["a1", "a2"] and len(pool.sessions) == 1
    pool.run()
    assert sorted(n for n, *_ in done) == ["a1", "a2", "b1"] and pool.sessions == []


# --- ranking ------------------------------------------------------------------------------------
