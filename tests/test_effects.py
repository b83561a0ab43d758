"""Effects from planted timings: a known difference is found with an interval that covers it, an
equality is stated as a tie with its bound, and only ways that differ in one factor are paired."""

import json
import math
import random

import pandas as pd
import pytest

from harness.measure.journal import JOURNAL_FILE, Journal, Sample
from harness.sweep.facts import ways_of
from harness.report import effects, findings
from harness.results import JOBS_FILE, RESULTS_FILE, read_csv

# (variant, options, compile): separate is 1.2x slower than fused; reshape exactly as fast as view.
WAYS = {
    ("separate", "attention=sdpa merge=view", "off"): 1.2,
    ("fused", "attention=sdpa merge=view", "off"): 1.0,
    ("separate", "attention=sdpa merge=reshape", "off"): 1.2,
    ("fused", "attention=manual merge=reshape", "off"): 1.0,  # differs from every other in two+
    ("reference", "", "off"): 1.5,
    ("reference", "", "default"): 0.75,  # nn.MHA compiled: 2x
}
SHAPES = [dict(seq_len=L, mask=m) for L in (128, 512) for m in ("none", "causal")]
ROUNDS = 11


def plant(root, rerun_noise=0.0, noise=0.02, seed=0):
    """A sweep dir as the harness leaves it: rows, jobs.json and the rounds' journal, with every
    round's times drifting together by up to 25% and 2% noise of their own."""
    rng = random.Random(seed)
    journal = Journal(root / JOURNAL_FILE)
    rows, jobs = [], []
    drift = [rng.uniform(0.8, 1.25) for _ in range(ROUNDS)]
    for s, shape in enumerate(SHAPES):
        base_ms = 0.5 * shape["seq_len"] / 128
        for w, ((variant, options, mode), factor) in enumerate(WAYS.items()):
            h = f"{s:02d}{w:02d}" + "ab" * 7
            job = f"{s * len(WAYS) + w}"
            times = [
                base_ms * factor * drift[r] * math.exp(rng.gauss(0, noise)) for r in range(ROUNDS)
            ]
            for r, ms in enumerate(times):
                journal.append(f"{job}:{h}", Sample(r, 1000.0 + r, ms, "run-1"))
            ref = 1.5 * base_ms
            rows.append(
                dict(
                    variant=variant,
                    variant_options=options or None,
                    label=variant + ("/" + options.replace(" ", ",") if options else ""),
                    compile=mode,
                    sdpa_backend="auto",
                    batch=2,
                    seq_len=shape["seq_len"],
                    embed_dim=256,
                    num_heads=4,
                    dtype="float32",
                    device="cpu",
                    mask=shape["mask"],
                    status="ok",
                    latency_ms_median=base_ms * factor,
                    speedup=ref / (base_ms * factor),
                    speedup_ci_low=ref / (base_ms * factor) * 0.9,
                    speedup_ci_high=ref / (base_ms * factor) * 1.1,
                    peak_mem_mb=1.0,
                    rerun_noise=rerun_noise,
                    config_hash=h,
                )
            )
            jobs.append({"dir": job, "config_hash": h})
    journal.close()
    (root / JOBS_FILE).write_text(json.dumps({"jobs": jobs}))
    df = pd.DataFrame(rows)
    df.to_csv(root / RESULTS_FILE, index=False)
    return read_csv(root / RESULTS_FILE)


def comparison(table, factor, base, alt):
    return table[
        (table["factor"] == factor) & (table["baseline"] == base) & (table["alternative"] == alt)
    ]


def test_a_planted_difference_is_found_and_an_equality_is_a_tie(tmp_path):
    df = plant(tmp_path)
    table, summary = effects.write(tmp_path, df)
    assert (tmp_path / effects.EFFECTS_FILE).exists() and (tmp_path / effects.SUMMARY_FILE).exists()
    assert set(table["basis"]) == {"rounds"} and set(table["n_pairs"]) == {ROUNDS}
    fused = comparison(table, "structure", "separate", "fused")
    assert len(fused) == len(SHAPES)  # one pair per shape: only sdpa/view has both structures
    for r in fused.to_dict("records"):  # the drift (up to 25% per round) cancels in the pairs
        assert r["verdict"] == "faster" and abs(r["ratio"] - 1.2) < 0.03, r
    merge = comparison(table, "merge", "view", "reshape")
    assert len(merge) == len(SHAPES) and set(merge["verdict"]) == {"tie"}
    compiled = comparison(table, "compile", "off", "default")
    assert len(compiled) == len(SHAPES) and (abs(compiled["ratio"] - 2) < 0.06).all()
    # manual/reshape differs from each other way in two factors or more: in no pair
    assert not table["context"].str.contains("attention=manual").any()
    assert not (table["alternative_way"].str.contains("manual")).any()

    top = summary[summary["by"] == "all"].set_index(["factor", "baseline", "alternative"])
    s = top.loc[("structure", "separate", "fused")]
    assert s["n"] == len(SHAPES) and s["faster"] == len(SHAPES)
    assert s["ratio_ci_low"] <= 1.2 <= s["ratio_ci_high"] and s["verdict"] == "faster"
    assert top.loc[("merge", "view", "reshape"), "verdict"] == "tie"
    by_seq = summary[(summary["factor"] == "structure") & (summary["by"] == "seq_len")]
    assert sorted(by_seq["value"]) == ["128", "512"]

    said = {f["factor"]: f["text"] for f in findings.findings(summary, ways=ways_of(df))}
    assert said["structure"].startswith("one fused QKV projection is 1.2")
    assert "faster than three Linear projections" in said["structure"]
    assert "the same speed within" in said["merge"]
    bound = int(said["merge"].split("within ")[1].split("%")[0])
    assert 0 < bound <= 5  # 2% noise per round, no floor: a tight tie


def test_the_intervals_cover_the_planted_ratio_95_times_in_100(tmp_path):
    covered = total = 0
    for seed in range(30):
        root = tmp_path / str(seed)
        root.mkdir()
        table = effects.effects(plant(root, seed=seed), root)
        fused = comparison(table, "structure", "separate", "fused")
        covered += int(((fused["ratio_ci_low"] <= 1.2) & (1.2 <= fused["ratio_ci_high"])).sum())
        total += len(fused)
    assert total == 30 * len(SHAPES)
    assert 0.88 <= covered / total <= 1.0, covered / total  # 95% intervals: 114 of 120 expected


def test_the_rerun_floor_widens_every_effect_and_a_tie_says_its_bound(tmp_path):
    df = plant(tmp_path, rerun_noise=0.04)
    table, summary = effects.write(tmp_path, df)
    merge = comparison(table, "merge", "view", "reshape")
    half = (merge["ratio_ci_high"] / merge["ratio_ci_low"]).map(math.log) / 2
    assert (half >= 1.96 * 0.04 - 1e-9).all()  # never narrower than the floor
    assert set(table["rerun_noise"]) == {0.04}
    text = [f["text"] for f in findings.findings(summary) if f["factor"] == "merge"][0]
    assert "the same speed within 8%" in text or "the same speed within 9%" in text


def test_without_the_journal_effects_come_from_the_speedups(tmp_path):
    df = plant(tmp_path)
    (tmp_path / JOURNAL_FILE).unlink()
    table = effects.effects(df, tmp_path)
    assert set(table["basis"]) == {"speedups"} and set(table["n_pairs"]) == {0}
    fused = comparison(table, "structure", "separate", "fused")
    assert (abs(fused["ratio"] - 1.2) < 1e-9).all()
    # the two speedups' intervals (+-10% each) combine in quadrature
    assert (fused["ratio_ci_high"] / fused["ratio"] > 1.1).all()


def test_rounds_of_different_runs_are_not_paired(tmp_path):
    """A resumed sweep's rounds: a pair is two repetitions of the same round of the same run."""
    df = plant(tmp_path)
    h_sep, h_fused = df["config_hash"].iloc[0], df["config_hash"].iloc[1]
    times = effects.round_times(tmp_path, df)
    assert len(times[h_sep]) == ROUNDS
    # rewrite the fused way's rounds as another run's: it then pairs with nothing
    lines = (tmp_path / JOURNAL_FILE).read_text().splitlines()
    moved = [ln.replace('"run-1"', '"run-2"') if h_fused in ln else ln for ln in lines]
    (tmp_path / JOURNAL_FILE).write_text("\n".join(moved) + "\n")
    table = effects.effects(df, tmp_path)
    first = table[(table["baseline_way"] == df["label"].iloc[0]) & (table["seq_len"] == 128)]
    pair = first[(first["alternative_way"] == df["label"].iloc[1]) & (first["mask"] == "none")]
    assert pair["basis"].tolist() == ["speedups"]


@pytest.mark.parametrize(
    "a, b, expected",
    [
        (
            {"structure": "fused", "compile": "off"},
            {"structure": "fused", "compile": "default"},
            "compile",
        ),
        (
            {"structure": "fused", "merge": "view"},
            {"structure": "packed", "merge": "view"},
            "structure",
        ),
        (
            {"structure": "fused", "merge": "view"},
            {"structure": "packed", "merge": "reshape"},
            None,
        ),
        ({"structure": "reference"}, {"structure": "fused", "merge": "view"}, None),
        ({"structure": "fused"}, {"structure": "fused"}, None),
    ],
)
def test_ways_pair_when_they_differ_in_exactly_one_factor(a, b, expected):
    assert effects.differs_in_one(a, b) == expected


def test_a_row_reads_as_its_factors():
    row = {"variant": "fused", "variant_options": "attention=flex merge=view", "compile": "default"}
    assert effects.factors(row) == {
        "structure": "fused",
        "attention": "flex",
        "merge": "view",
        "compile": "default",
        "sdpa_backend": "auto",
    }
    assert effects.factors({"variant": "reference", "variant_options": float("nan")}) == {
        "structure": "reference",
        "compile": "off",
        "sdpa_backend": "auto",
    }


def summary_rows(rows):
    base = {"factor": "compile", "baseline": "off", "alternative": "default"}
    return pd.DataFrame([{**base, **r} for r in rows])


def test_a_finding_says_where_the_effect_moves_and_when_there_is_no_single_answer():
    moving = summary_rows(
        [
            dict(
                by="all",
                value="",
                n=8,
                ratio=1.41,
                ratio_ci_low=0.9,
                ratio_ci_high=2.2,
                ratio_min=0.95,
                ratio_max=2.1,
                faster=4,
                ties=4,
                slower=0,
                verdict="tie",
            ),
            dict(
                by="seq_len",
                value="128",
                n=4,
                ratio=2.0,
                ratio_ci_low=1.9,
                ratio_ci_high=2.1,
                ratio_min=1.9,
                ratio_max=2.1,
                faster=4,
                ties=0,
                slower=0,
                verdict="faster",
            ),
            dict(
                by="seq_len",
                value="512",
                n=4,
                ratio=1.0,
                ratio_ci_low=0.95,
                ratio_ci_high=1.05,
                ratio_min=0.95,
                ratio_max=1.05,
                faster=0,
                ties=4,
                slower=0,
                verdict="tie",
            ),
            # overlapping groups are not a difference the rounds can tell: not said
            dict(
                by="mask",
                value="none",
                n=4,
                ratio=1.6,
                ratio_ci_low=0.9,
                ratio_ci_high=2.5,
                ratio_min=1,
                ratio_max=2,
                faster=2,
                ties=2,
                slower=0,
                verdict="tie",
            ),
            dict(
                by="mask",
                value="causal",
                n=4,
                ratio=1.2,
                ratio_ci_low=0.8,
                ratio_ci_high=1.9,
                ratio_min=1,
                ratio_max=2,
                faster=2,
                ties=2,
                slower=0,
                verdict="tie",
            ),
        ]
    )
    text = findings.findings(moving)[0]["text"]
    assert "it depends on seq_len: 2.00x at seq_len=128, 1.00x at seq_len=512" in text
    assert "mask" not in text and "cannot be told apart" in text  # [0.9, 2.2] is no tie bound
    mixed = summary_rows(
        [
            dict(
                by="all",
                value="",
                n=20,
                ratio=1.0,
                ratio_ci_low=0.9,
                ratio_ci_high=1.1,
                ratio_min=0.6,
                ratio_max=1.6,
                faster=6,
                ties=8,
                slower=6,
                verdict="tie",
            )
        ]
    )
    assert "no single answer" in findings.findings(mixed)[0]["text"]
    chance = summary_rows(  # 2 of 68 each way: what 95% intervals miss by chance, still a tie
        [
            dict(
                by="all",
                value="",
                n=68,
                ratio=1.0,
                ratio_ci_low=0.93,
                ratio_ci_high=1.08,
                ratio_min=0.87,
                ratio_max=1.09,
                faster=2,
                ties=64,
                slower=2,
                verdict="tie",
            )
        ]
    )
    assert "the same speed within 8%" in findings.findings(chance)[0]["text"]
