"""The earned between-run floor (harness/floors.py; docs/methodology.md, "The earned floor"):
does the floor rule cover a re-run, and did today's in-run estimator?

The drift model, simulated (log times; every random draw seeded):

- a shape has ``WAYS`` ways and the reference (nn.MultiheadAttention); a run times each of them
  in ``ROUNDS`` rounds (``timing.rounds``' default, 11); the speedup is the per-round ratio
  reference / way (``stats.paired_ratio``);
- in each run, every point at the shape gets a run offset: a part shared by every way at the
  shape (sd ``RUN_SD``: it cancels in the speedup) and a part of each way's own (sd
  ``SIGMA / sqrt(2)``: the ways respond differently to the run's conditions; it does not
  cancel). The speedup's between-run sd per run, the floor an interval needs, is then exactly
  ``SIGMA``; no round of a run sees it (it is constant over the run's rounds);
- in each run, the rounds after the middle one drift by D (sd ``sqrt(2) * SIGMA``), shared by
  every way at the shape: one degree of freedom per shape and run. Its size is what
  ``stats.drift_floor`` assumes (the drift a run's halves show is on the scale of what a re-run
  adds: E[drift_floor^2] = SIGMA^2), the case most favourable to today's rule;
- each round adds independent noise, sd ``ROUND_SD`` per point (a GPU-like machine, where the
  floor, not the rounds, sets the width).

An interval covers a re-run when |c_A - c_B| <= sqrt(hw_A^2 + hw_B^2) on logs (scripts/
stability.py's test of agreement). Each trial is a fresh machine: a simulated ``make stability``
(the small sweep: 8 shapes x 3 ways + nn.MHA, runs A and B) earns the floor
(``floors.from_reruns``' upper bound over its 24 speedups, grouped by shape); then one more shape
is run twice and its 3 speedups' intervals are checked against each other under

- today's rule: floor = ``stats.drift_floor`` of the shape's rounds in that run (0.02 where it
  cannot be measured);
- the floor rule: ``floors.floor_rule(earned, in_run, assumed=0.02)``, ``in_run`` what the
  harness measures inside a run (harness/measure/rounds.py: drift_floor over each way's
  per-round ratio to nn.MHA; the shared drift cancels there).

Figures (seed 54; 400 machines x 4 shapes checked, 4800 speedups): today's rule covers 0.824
(standard error 0.007): drift_floor has one degree of freedom per run, so two runs give the
floor a chi-square of about 2 degrees and the coverage is about that of a t interval with 2
degrees of freedom at 1.96, 0.81. The floor rule covers 0.977 (0.003); the earned bound is at
least SIGMA in 0.89 of the machines (0.90 asked); the point estimate in its place, 0.935. The
standard errors are taken over machines (the speedups of one machine share its earned floor),
and each assertion holds at least 3 of them away from the simulated figure.
"""

from __future__ import annotations

import json
import math
import os
import random
import statistics
import sys
from datetime import date
from pathlib import Path

import pandas as pd
import pytest

from harness import floors
from harness import config
from harness.config import CUDA_FLOOR, InvalidPoint, Timing
from harness.measure import stats

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import gpu_check  # noqa: E402
import stability  # noqa: E402

ROUNDS = Timing().rounds  # the default: 11
WAYS = 3  # ways a shape, besides the reference (the small sweep's)
SHAPES = 8  # shapes of the simulated make stability (8 x 3 speedups)
SIGMA = 0.03  # the true between-run floor of a speedup, per run
RUN_SD = 0.10  # the run offset every way at a shape shares (cancels in the speedup)
ROUND_SD = 0.01  # round-to-round noise of one point
TRIALS = 400  # machines, each with a make stability of its own
CHECKED = 4  # shapes run twice on each machine, their speedups checked against the re-run
SEED = 54


def run(rng: random.Random, mu: list[float]) -> list[list[float]]:
    """One run of one shape: each point's times in round order (the reference first)."""
    shared = rng.gauss(0, RUN_SD)
    drift = rng.gauss(0, math.sqrt(2) * SIGMA)
    out = []
    for m in mu:
        own = rng.gauss(0, SIGMA / math.sqrt(2))
        out.append(
            [
                math.exp(
                    m + shared + own + (drift if r >= ROUNDS // 2 else 0.0) + rng.gauss(0, ROUND_SD)
                )
                for r in range(ROUNDS)
            ]
        )
    return out


def speedups(series: list[list[float]], floor: float) -> list[stats.Interval]:
    return [stats.paired_ratio(series[0], way, floor) for way in series[1:]]


def within_var(series: list[list[float]]) -> list[float]:
    """Each speedup's variance of its centre that the rounds predict (se^2), read back from its
    interval as scripts/stability.py reads a row's."""
    out = []
    for way in series[1:]:
        iv = stats.paired_ratio(series[0], way)
        out.append((stats.log_halfwidth(iv.low, iv.high) / stats.t975(stats.rounds_df(iv.n))) ** 2)
    return out


def in_run(series: list[list[float]]) -> float | None:
    """The floor the harness measures inside a run to widen the earned one (harness/measure/
    rounds.py's measured_floor): drift_floor over each way's per-round ratio to nn.MHA."""
    return stats.drift_floor([[r / w for r, w in zip(series[0], way)] for way in series[1:]])


def covers(a: stats.Interval, b: stats.Interval) -> bool:
    half = math.hypot(stats.log_halfwidth(a.low, a.high), stats.log_halfwidth(b.low, b.high))
    return abs(math.log(a.center / b.center)) <= half


def shape(rng: random.Random) -> list[float]:
    return [rng.gauss(0, 0.3) for _ in range(WAYS + 1)]


def earn(rng: random.Random) -> tuple[float, float]:
    """A simulated make stability: (estimate, upper) from two runs of SHAPES shapes."""
    return floors.pooled([rerun_of(rng)])[:2]


def rerun_of(rng: random.Random) -> floors.Rerun:
    """A simulated make stability's evidence: two runs of SHAPES shapes."""
    d, within, groups = [], [], []
    for g in range(SHAPES):
        mu = shape(rng)
        a, b = run(rng, mu), run(rng, mu)
        for ia, ib, wa, wb in zip(speedups(a, 0), speedups(b, 0), within_var(a), within_var(b)):
            d.append(math.log(ib.center / ia.center))
            within.append(wa + wb)
            groups.append(g)
    return floors.Rerun("2026-11-26", tuple(d), tuple(within), tuple(groups))


def coverage(hits: list[float]) -> tuple[float, float]:
    """Mean coverage over trials and its standard error (trials independent)."""
    return statistics.fmean(hits), statistics.stdev(hits) / math.sqrt(len(hits))


@pytest.fixture(scope="module")
def simulated() -> dict:
    rng = random.Random(SEED)
    old, new, point, bound = [], [], [], []
    for _ in range(TRIALS):
        estimate, upper = earn(rng)
        bound.append(upper >= SIGMA)
        rules = {"old": [], "new": [], "point": []}
        for _ in range(CHECKED):
            mu = shape(rng)
            a, b = run(rng, mu), run(rng, mu)
            old_a, old_b = stats.drift_floor(a), stats.drift_floor(b)
            in_a, in_b = in_run(a), in_run(b)
            for name, earned in (("old", None), ("new", upper), ("point", estimate)):
                if name == "old":  # today's: the in-run floor of the points' times alone
                    fa = CUDA_FLOOR if old_a is None else old_a
                    fb = CUDA_FLOOR if old_b is None else old_b
                else:
                    fa = floors.floor_rule(earned, in_a, CUDA_FLOOR)[0]
                    fb = floors.floor_rule(earned, in_b, CUDA_FLOOR)[0]
                rules[name] += [covers(x, y) for x, y in zip(speedups(a, fa), speedups(b, fb))]
        old.append(statistics.fmean(rules["old"]))
        new.append(statistics.fmean(rules["new"]))
        point.append(statistics.fmean(rules["point"]))
    return {
        "old": coverage(old),
        "new": coverage(new),
        "point": coverage(point),
        "bound": coverage([float(x) for x in bound]),
    }


def test_todays_in_run_floor_does_not_cover_a_rerun(simulated):
    cover, se = simulated["old"]
    assert cover < 0.88
    assert cover + 3 * se < 0.88  # not a near miss: the figure is 3 standard errors below


def test_the_earned_floor_rule_covers_a_rerun_at_least_90_percent(simulated):
    cover, se = simulated["new"]
    assert cover >= 0.90
    assert cover - 3 * se >= 0.90


def test_the_earned_bound_covers_the_true_floor_about_as_often_as_its_confidence(simulated):
    # floors.CONFIDENCE (0.90) with the shapes' correlation taken into account
    cover, se = simulated["bound"]
    assert abs(cover - floors.CONFIDENCE) <= 3 * se + 0.02


def test_a_point_estimate_covers_less_than_its_upper_bound(simulated):
    assert simulated["point"][0] < simulated["new"][0]


# --- the estimator ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "p, df, exact",
    [(0.10, 3, 0.5844), (0.10, 10, 4.8652), (0.10, 24, 15.6587), (0.90, 10, 15.9872)],
)
def test_chi2_quantile_within_one_and_a_half_percent(p, df, exact):
    assert floors.chi2_quantile(p, df) == pytest.approx(exact, rel=0.015 if df < 10 else 0.003)


def test_from_reruns_needs_three_points_and_bounds_the_estimate():
    assert all(math.isnan(x) for x in floors.from_reruns([0.01, -0.02], [1e-4, 1e-4]))
    rng = random.Random(1)
    d = [rng.gauss(0, math.sqrt(2) * 0.03) for _ in range(2000)]
    estimate, upper = floors.from_reruns(d, [0.0] * len(d))
    assert estimate == pytest.approx(0.03, rel=0.05)
    assert estimate <= upper < estimate * 1.1
    # the rounds explain every difference: no floor
    d = [rng.gauss(0, 0.01) for _ in range(50)]
    assert floors.from_reruns(d, [1e-3] * len(d)) == (0.0, 0.0)


def test_from_reruns_upper_bound_covers_90_percent_of_independent_reruns():
    rng = random.Random(2)
    hits = 0
    for _ in range(1000):
        w = [rng.uniform(0, 4e-4) for _ in range(24)]
        d = [rng.gauss(0, math.sqrt(2 * 0.03**2 + wi)) for wi in w]
        hits += floors.from_reruns(d, w)[1] >= 0.03
    assert 0.87 <= hits / 1000 <= 0.93  # binomial sd 0.0095


def test_correlated_points_of_a_shape_widen_the_bound():
    rng = random.Random(3)
    d, groups = [], []
    for g in range(8):
        common = rng.gauss(0, 0.04)
        for _ in range(3):
            d.append(common + rng.gauss(0, 0.01))
            groups.append(g)
    w = [1e-5] * len(d)
    assert floors.from_reruns(d, w, groups=groups)[1] > floors.from_reruns(d, w)[1]
    assert floors.from_reruns(d, w, groups=groups)[0] == floors.from_reruns(d, w)[0]


# --- the rule -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "earned, in_run, expected",
    [
        (0.03, None, (0.03, "earned")),
        (0.03, 0.01, (0.03, "earned")),  # the in-run floor never narrows an earned one
        (0.03, 0.03, (0.03, "earned")),
        (0.03, 0.05, (0.05, "rounds")),  # ... it widens it
        (0.03, math.nan, (0.03, "earned")),
        (0.0, 0.0, (0.0, "earned")),
        (None, None, (0.02, "assumed")),
        (None, 0.01, (0.02, "assumed")),  # nor an assumed one
        (None, 0.05, (0.05, "rounds")),
        (None, math.nan, (0.02, "assumed")),
    ],
)
def test_floor_rule(earned, in_run, expected):
    assert floors.floor_rule(earned, in_run, 0.02) == expected


@pytest.mark.parametrize("bad", [(-0.01, None, 0.02), (None, -1.0, 0.02), (None, None, -0.02)])
def test_floor_rule_refuses_negative_floors(bad):
    with pytest.raises(ValueError):
        floors.floor_rule(*bad)


# --- the file -------------------------------------------------------------------------------


def test_store_and_load_round_trip(tmp_path):
    path = tmp_path / "floors.json"
    assert floors.load(path) == {} and floors.earned("cpu", path) is None
    cpu = floors.store(
        "cpu", 0.03201, "AMD EPYC, 2 cores", "make stability", 24, 0.021, 0.03201, path=path
    )
    assert cpu.value == 0.0321  # rounded up, never down
    assert cpu.measured == date.today().isoformat()
    floors.store(
        "cuda:0",
        0.004,
        "NVIDIA H100",
        "make gpu-check STEP=stability",
        24,
        0.002,
        0.004,
        path=path,
        measured="2026-11-26",
    )
    assert floors.earned("cpu", path) == cpu
    gpu = floors.earned("cuda:1", path)
    assert (gpu.value, gpu.measured, gpu.machine, gpu.by) == (
        0.004,
        "2026-11-26",
        "NVIDIA H100",
        "make gpu-check STEP=stability",
    )
    data = json.loads(path.read_text())
    assert list(data) == ["cpu", "cuda"]
    assert data["cuda"] == {
        "rerun_noise": 0.004,
        "measured": "2026-11-26",
        "machine": "NVIDIA H100",
        "by": "make gpu-check STEP=stability",
        "points": 24,
        "estimate": 0.002,
        "upper": 0.004,
    }
    # a second store replaces its kind only, and leaves no temporary file behind
    floors.store("cpu", 0.05, "AMD EPYC, 2 cores", "make stability", path=path)
    assert floors.earned("cpu", path).value == 0.05 and floors.earned("cuda", path) == gpu
    assert os.listdir(tmp_path) == ["floors.json"]
    assert path.stat().st_mode & 0o777 == 0o644


def test_store_refuses_what_would_not_read_back(tmp_path):
    path = tmp_path / "floors.json"
    for kind, value in (("tpu", 0.03), ("cpu", math.nan), ("cpu", 1.5), ("cpu", -0.1)):
        with pytest.raises(ValueError):
            floors.store(kind, value, "m", "by", path=path)
    assert not path.exists()


@pytest.mark.parametrize(
    "text",
    [
        "not json",
        "[]",
        '{"tpu": {"rerun_noise": 0.03, "measured": "2026-11-26", "machine": "m", "by": "b"}}',
        '{"cpu": {"rerun_noise": 0.03, "machine": "m", "by": "b"}}',
        '{"cpu": {"rerun_noise": 2, "measured": "2026-11-26", "machine": "m", "by": "b"}}',
        '{"cpu": {"rerun_noise": 0.03, "measured": "yesterday", "machine": "m", "by": "b"}}',
        '{"cpu": {"rerun_noise": 0.03, "measured": "2026-11-26", "machine": "m", "by": "b", '
        '"reruns": [{"measured": "2026-11-26", "d": [0.1, 0.2], "within": [0.1], '
        '"shapes": [0, 0]}]}}',
        '{"cpu": {"rerun_noise": 0.03, "measured": "2026-11-26", "machine": "m", "by": "b", '
        '"reruns": [{"d": [0.1], "within": [0.1], "shapes": [0]}]}}',
    ],
)
def test_a_damaged_file_is_refused(tmp_path, text):
    path = tmp_path / "floors.json"
    path.write_text(text)
    with pytest.raises(ValueError):
        floors.earned("cpu", path)


def test_a_damaged_floors_file_refuses_a_point_in_one_line(tmp_path, monkeypatch):
    path = tmp_path / "floors.json"
    path.write_text('{"cpu": {"rerun_noise": 0.03}}')
    monkeypatch.setattr(floors, "PATH", path)
    monkeypatch.setattr(floors.earned, "__defaults__", (path,))
    with pytest.raises(InvalidPoint, match="missing by, machine, measured .*make stability"):
        config.rerun_floor("cpu")


def test_the_repositorys_floors_are_earned_and_dated():
    stored = floors.load()
    assert "cpu" in stored
    for kind, f in stored.items():
        assert f.value >= (f.upper or 0) >= (f.estimate or 0), kind
        assert f.points and f.points >= floors.MIN_POINTS
        assert "stability" in f.by and f.machine


# --- scripts/stability.py and gpu_check.py --------------------------------------------------


def stability_rows(rng: random.Random, speedups: dict, floor: float = 0.04) -> pd.DataFrame:
    """A run's rows as results.csv has them: 8 shapes x nn.MHA and 3 ways, each speedup with an
    interval of 11 rounds (se 0.01) plus the floor."""
    rows = []
    for g in range(8):
        for way in ("reference", "fused", "packed", "separate"):
            s = 1.0 if way == "reference" else speedups[(g, way)]
            se = 0.0 if way == "reference" else 0.01
            half = math.hypot(stats.t975(stats.rounds_df(11)) * se, stats.Z975 * floor)
            rows.append(
                dict(
                    variant=way,
                    label=way,
                    seq_len=128 * (1 + g // 4),
                    dtype="float32" if g % 2 else "bfloat16",
                    mask="causal" if g % 4 >= 2 else "none",
                    device="cpu",
                    device_name="AMD EPYC",
                    status="ok",
                    speedup=s,
                    speedup_ci_low=s * math.exp(-half),
                    speedup_ci_high=s * math.exp(half),
                    rerun_noise=floor,
                    n_samples=11,
                )
            )
    return pd.DataFrame(rows)


def test_stability_measures_the_floor_from_two_runs_and_stores_it(tmp_path):
    rng = random.Random(7)
    keys = [(g, w) for g in range(8) for w in ("fused", "packed", "separate")]
    base = {k: math.exp(rng.gauss(0, 0.3)) for k in keys}
    d = {k: rng.gauss(0, 0.05) for k in keys}
    a = stability_rows(rng, base)
    b = stability_rows(rng, {k: base[k] * math.exp(d[k]) for k in keys})
    rerun = stability.rerun_floor(a, b, 0.04)
    estimate, upper, points = floors.pooled([rerun])
    assert points == 24 and len(set(rerun.shapes)) == 8
    # the same as the estimator over the same differences: se^2 + se^2 each, grouped by shape
    expected = floors.from_reruns(
        [d[k] for k in keys], [2 * 0.01**2] * 24, groups=[g for g, _ in keys]
    )
    assert (estimate, upper) == pytest.approx(expected, rel=1e-5)
    assert 0 < estimate < upper

    path = tmp_path / "floors.json"
    stored = stability.store_floor(a, rerun, "make stability", path, fresh=False)
    assert stored["kind"] == "cpu" and stored["rerun_noise"] >= upper
    assert stored["reruns_pooled"] == 1
    f = floors.earned("cpu", path)
    assert f.machine.startswith("AMD EPYC, ") and f.machine.endswith(" cores")
    assert (f.points, f.by, f.measured) == (24, "make stability", date.today().isoformat())
    # too few points measured in both runs: nothing stored, and why
    few = stability.rerun_floor(a.iloc[:3], b.iloc[:3], 0.04)  # nn.MHA and 2 ways
    assert len(few.d) == 2 and all(math.isnan(x) for x in floors.pooled([few])[:2])
    said = stability.store_floor(a, few, "make stability", tmp_path / "x.json", fresh=False)
    assert said.startswith("not stored") and not (tmp_path / "x.json").exists()


def test_each_rerun_pair_tightens_the_earned_floor_on_one_machine_and_another_machine_starts_over(
    tmp_path,
):
    path = tmp_path / "floors.json"
    rng = random.Random(3)
    runs = [rerun_of(rng) for _ in range(floors.MAX_RUNS + 1)]
    alone = [floors.pooled([r]) for r in runs]
    stored = [floors.earn("cpu", r, "AMD EPYC, 2 cores", "make stability", path=path) for r in runs]
    # every stored floor is the bound over the re-runs pooled so far (the last MAX_RUNS)
    assert [len(f.reruns) for f in stored] == [1, 2, 3, 4, 5, 5]
    assert stored[-1].reruns[0] == floors.earned("cpu", path).reruns[0] != stored[0].reruns[0]
    assert [f.points for f in stored] == [24, 48, 72, 96, 120, 120]
    # the bound over five pairs sits closer to its estimate than any single pair's
    ratio = stored[4].upper / stored[4].estimate
    assert all(ratio < up / est for est, up, _ in alone if est > 0)
    assert floors.earned("cpu", path) == stored[-1]  # what was stored reads back
    # another machine's spread says nothing of this one: its first re-run stands alone
    other = floors.earn("cpu", runs[0], "Intel Xeon, 8 cores", "make stability", path=path)
    assert len(other.reruns) == 1 and other.upper == pytest.approx(alone[0][1], rel=1e-4)
    fresh = floors.earn("cpu", runs[1], "Intel Xeon, 8 cores", "make stability", True, path)
    assert len(fresh.reruns) == 1


def test_make_stability_and_the_gpu_check_store_the_floor(tmp_path):
    makefile = (Path(__file__).resolve().parent.parent / "Makefile").read_text()
    assert "scripts/stability.py --store-floor" in makefile
    cmd = gpu_check.command("stability", tmp_path)
    assert "--store-floor" in cmd
    assert cmd[cmd.index("--by") + 1] == "make gpu-check STEP=stability"
    assert gpu_check.FLOORS == floors.PATH


def test_the_pooled_bound_still_covers_the_true_floor_90_percent_of_the_time():
    rng = random.Random(11)
    sims = 300
    hits = sum(floors.pooled([rerun_of(rng) for _ in range(3)])[1] >= SIGMA for _ in range(sims))
    se = (floors.CONFIDENCE * (1 - floors.CONFIDENCE) / sims) ** 0.5
    assert abs(hits / sims - floors.CONFIDENCE) <= 3 * se + 0.02


def test_reread_recomputes_an_earlier_pairs_speedups_from_its_journal(tmp_path):
    """``make stability``'s runs re-read with today's estimator (``--reread``): each way pairs
    with nn.MHA's rounds at its own shape, contended rounds left out, the row's floor kept."""
    from harness.measure.journal import Journal, Sample

    rng = random.Random(5)
    rows, journal = [], Journal(tmp_path / "rounds.jsonl")
    expected = {}
    for job, (seq, label) in enumerate((s, w) for s in (128, 512) for w in ("reference", "fused")):
        config_hash = f"{job:016x}"
        rows.append(
            dict(
                label=label,
                seq_len=seq,
                status="ok",
                config_hash=config_hash,
                rerun_noise=0.01,
                speedup=9.0,
                speedup_ci_low=8.0,
                speedup_ci_high=10.0,
                n_samples=3,
            )
        )
        base = (4.0 if seq == 512 else 1.0) / (1.0 if label == "reference" else 1.5)
        times = [base * math.exp(rng.gauss(0, 0.05)) for _ in range(11)]
        times[3] *= 3 if label == "fused" else 1  # one disturbed round
        for r, ms in enumerate(times):
            journal.append(f"{job}:{config_hash}", Sample(r, 0.0, ms, "run1", None, 0, None, False))
        journal.append(f"{job}:{config_hash}", Sample(11, 0.0, ms * 9, "run1", None, 0, None, True))
        expected[(seq, label)] = times
    journal.close()
    pd.DataFrame(rows).to_csv(tmp_path / "results.csv", index=False)
    got = stability.reread(tmp_path).set_index(["seq_len", "label"])
    for seq in (128, 512):
        want = stats.paired_ratio(expected[(seq, "reference")], expected[(seq, "fused")], 0.01)
        row = got.loc[(seq, "fused")]
        assert (row["speedup"], row["speedup_ci_low"], row["speedup_ci_high"]) == pytest.approx(
            (want.center, want.low, want.high)
        )
        assert row["speedup"] == pytest.approx(1.5, rel=0.05)  # its own shape's reference
        assert got.loc[(seq, "reference"), "speedup"] == 9.0  # nn.MHA's rows as they were
