"""A busy machine decides nothing (issue 54, the report's side): rows whose timing rounds stayed
contended by other processes (``contended``) name no winner, make no effect, are never an A/B
regression, and the findings, the report and compare open by saying so. Also the sentences that
could contradict themselves: an interval too wide to bound a tie, and a fastest way slower than
nn.MultiheadAttention. Synthetic rows only (no torch, no sweep)."""

import json
import re

import pandas as pd

from harness.measure.journal import JOURNAL_FILE, Journal, Sample
from harness.report import analysis, compare, effects, findings, ranking
from harness.report import render as report
from harness.report.busy import busy_line, contended
from harness.results import JOBS_FILE, RESULTS_FILE, read_csv

BUSY = dict(contended=True, busy_cores=1.6, cores=2, cpu_wait=0.48, contended_rounds=5)


def row(variant, speedup, half=0.05, options="attention=sdpa merge=view", **keys):
    """A correct timed row: ``speedup`` over nn.MHA with a +-``half`` interval, not contended."""
    base = dict(
        variant=variant,
        variant_options=options or None,
        label=variant + ("/" + options.replace(" ", ",") if options else ""),
        status="ok",
        compile="off",
        sdpa_backend="auto",
        batch=2,
        seq_len=128,
        embed_dim=256,
        num_heads=4,
        dtype="float32",
        device="cpu",
        mask="none",
        mode="fwd",
        num_threads=2,
        latency_ms_median=1 / speedup,
        latency_ms_ci_low=0.95 / speedup,
        latency_ms_ci_high=1.05 / speedup,
        speedup=speedup,
        speedup_ci_low=speedup * (1 - half),
        speedup_ci_high=speedup * (1 + half),
        noise_target_met=True,
        rerun_noise=0.0,
        peak_mem_mb=1.0,
        contended=False,
        contention="",
    )
    return base | keys


def sweep(busy_at=(), lengths=(64, 128, 256, 512), fused=1.2, slow_at=(), half=0.05):
    """nn.MHA, separate and fused at each seq_len (fused ``fused`` x nn.MHA's speed, separate's
    1x; 1.2 / ``fused`` times slower at ``slow_at``); the ways at ``busy_at`` lengths were timed
    on a busy machine, where fused read 3x slower instead."""
    rows = []
    for L in lengths:
        busy = BUSY if L in busy_at else {}
        speed = 0.4 if busy else 1.0 if L in slow_at else fused
        rows += [
            row("reference", 1.0, options="", seq_len=L, config_hash=f"r{L}"),
            row("separate", 1.0, half, seq_len=L, config_hash=f"s{L}", **busy),
            row("fused", speed, half, seq_len=L, config_hash=f"f{L}", **busy),
        ]
    return pd.DataFrame(rows)


# --- the rows ------------------------------------------------------------------------------------


def test_contended_reads_every_spelling_and_older_rows_are_not():
    df = pd.DataFrame({"contended": [True, "True", "true", 1, "1", False, "False", "", None, 0]})
    assert contended(df).tolist() == [True] * 5 + [False] * 5
    assert not contended(pd.DataFrame({"x": [1, 2]})).any()  # a run from before the column
    assert busy_line(sweep()) == "" and busy_line(sweep().drop(columns="contended")) == ""


def test_the_busy_line_says_how_busy_how_many_and_what_to_do():
    line = busy_line(sweep(busy_at=(512,)))
    assert line.startswith("the machine was busy: other processes used 1.6 of 2 cores")
    assert "(2 of 12 points stayed contended after re-timing)" in line
    assert line.endswith("decide nothing here: re-run on a quiet machine or with num_threads=1.")
    one = busy_line(sweep(busy_at=(512,)).assign(num_threads=1))
    assert one.endswith("re-run on a quiet machine.")  # fewer threads would not help


# --- the ranking ---------------------------------------------------------------------------------


def test_a_shape_with_a_contended_way_names_no_winner():
    quiet = ranking.rank(sweep())
    assert set(quiet["winner"]) == {"fused/attention=sdpa,merge=view"} and set(quiet["busy"]) == {0}
    ranked = ranking.rank(sweep(busy_at=(512,))).set_index("seq_len")
    assert ranked.loc[512, "winner"] == "" and ranked.loc[512, "winner_factors"] == ""
    assert ranked.loc[512, "busy"] == 2 and ranked.loc[128, "winner"] != ""
    said = findings.fastest_finding(ranked.reset_index())
    assert "at 3 of 3 ranked shapes" in said and "every ranked shape has a clear winner" in said
    assert said.endswith("; 1 shape not ranked: the machine was busy.")
    assert findings.fastest_finding(ranking.rank(sweep(busy_at=(64, 128, 256, 512)))) == (
        "4 shapes not ranked: the machine was busy."
    )


# --- the effects ---------------------------------------------------------------------------------


def structure(summary):
    top = summary[(summary["factor"] == "structure") & (summary["by"] == "all")]
    return top[top["alternative"] == "fused"].iloc[0]


def test_busy_pairs_are_left_out_of_every_summary():
    table = effects.effects(sweep(busy_at=(512,)))
    pairs = table[(table["factor"] == "structure") & (table["alternative"] == "fused")]
    assert pairs.set_index("seq_len")["verdict"].to_dict()[512] == "busy"
    summary = effects.summarize(table)
    top = structure(summary)
    assert top["n"] == 3 and top["busy"] == 1 and top["verdict"] == "faster"
    assert abs(top["ratio"] - 1.2) < 1e-6 and top["ratio_min"] > 1  # 0.4x at 512: not in it
    by_len = summary[(summary["factor"] == "structure") & (summary["by"] == "seq_len")]
    assert by_len.set_index("value").loc["512", "verdict"] == "busy"
    text = [f["text"] for f in findings.findings(summary, table) if f["factor"] == "structure"][0]
    assert "1 more left out: the machine was busy" in text and "0.40" not in text


def test_a_comparison_whose_pairs_are_all_busy_is_not_measured():
    summary = effects.summarize(effects.effects(sweep(busy_at=(64, 128, 256, 512))))
    top = structure(summary)
    assert top["verdict"] == "busy" and top["n"] == 0 and top["busy"] == 4
    said = [f for f in findings.findings(summary) if f["factor"] == "structure"][0]
    assert said["text"].endswith("not measured: the machine was busy for all 4 pairs.")
    assert not re.search(r"\d\.\d\dx", said["text"])  # no ratio at all


def test_a_repetition_spoiled_by_contention_is_never_paired(tmp_path):
    """Two ways timed in 6 rounds; rounds 0-2 of the fused way were spoiled (10x) and re-timed:
    the journal marks them, and the effect pairs the clean rounds only."""
    df = sweep(lengths=(128,))
    journal, jobs = Journal(tmp_path / JOURNAL_FILE), []
    for h, ms in (("s128", 1.2), ("f128", 1.0)):
        for r in range(6):
            spoiled = h == "f128" and r < 3  # 10x: other processes held the cores
            ms_r = ms * (10 if spoiled else 1)
            journal.append(f"{h}:{h}", Sample(r, 100.0 + r, ms_r, "run-1", contended=spoiled))
        jobs.append({"dir": h, "config_hash": h})
    journal.close()
    (tmp_path / JOBS_FILE).write_text(json.dumps({"jobs": jobs}))
    times = effects.round_times(tmp_path, df)
    assert set(times["f128"]) == {("run-1", r) for r in range(3, 6)}
    pair = effects.effects(df, tmp_path)
    pair = pair[(pair["factor"] == "structure") & (pair["alternative"] == "fused")].iloc[0]
    assert pair["basis"] == "rounds" and pair["n_pairs"] == 3 and abs(pair["ratio"] - 1.2) < 1e-6


# --- the findings and the report ----------------------------------------------------------------


def test_the_busy_line_opens_the_findings_and_the_report(tmp_path):
    df = sweep(busy_at=(512,))
    said = analysis.analyze(df).findings
    assert said[0]["factor"] == "busy" and said[0]["text"] == busy_line(df)
    assert [f["factor"] for f in analysis.analyze(sweep()).findings][0] != "busy"
    html = report.render(df, tmp_path, [tmp_path])[0]
    body = html.split("<body>", 1)[1]
    first = re.sub(r"<h1>.*?</h1>\s*", "", body, count=1, flags=re.S).lstrip()
    assert first.startswith('<p class="busy" id="busy">The machine was busy: other processes')
    assert '<li class="busy"><b>busy</b>: the machine was busy' in html


def test_an_interval_too_wide_to_decide_says_so_and_nothing_that_contradicts_it():
    wide = pd.DataFrame(
        [
            dict(
                factor="compile",
                baseline="off",
                alternative="default",
                kernel_change="",
                by="all",
                value="",
                n=2,
                ratio=2.1234,
                ratio_ci_low=0.0063,
                ratio_ci_high=709.18,
                ratio_min=1.5,
                ratio_max=3.0,
                faster=2,
                ties=0,
                slower=0,
                verdict="tie",
                busy=0,
            )
        ]
    )
    text = findings.findings(wide)[0]["text"]
    assert "not measured well enough (interval 0.01-709x over 2 pairs)" in text, text
    assert "709.18" not in text and "2.12x" not in text and "2 faster" not in text


def test_a_fastest_way_slower_than_nn_mha_says_so():
    rows = [row("fused", 0.22, seq_len=L, config_hash=f"f{L}") for L in (64, 128)] + [
        row("separate", 0.1, seq_len=L, config_hash=f"s{L}") for L in (64, 128)
    ]
    said = findings.fastest_finding(ranking.rank(pd.DataFrame(rows)))
    assert "0.22x nn.MultiheadAttention's speed (every way measured here is slower than " in said


# --- A/B compare ---------------------------------------------------------------------------------


def run_dir(tmp_path, name, df):
    root = tmp_path / name
    root.mkdir()
    df.to_csv(root / RESULTS_FILE, index=False)
    return str(root)


def test_compare_never_judges_a_busy_point_and_exits_3(tmp_path, capsys):
    a = run_dir(tmp_path, "a", sweep(half=0.02))  # +-3% ratios: within the 5% threshold
    b = run_dir(tmp_path, "b", sweep(busy_at=(512,), half=0.02))  # fused 3x slower: busy
    assert compare.main([a, b, "--out", str(tmp_path / "ab.html")]) == compare.EXIT_NOT_COMPARABLE
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith(
        "not comparable: the machine was busy during run B: other processes used 1.6 of 2 cores"
    )
    assert "re-run on a quiet machine" in out.splitlines()[0] and "regression" not in out
    ab = read_csv(tmp_path / "ab.csv").set_index(["seq_len", "variant"])["verdict"]
    assert ab[(512, "fused")] == ab[(512, "separate")] == "not comparable (B busy)"
    assert set(ab.drop(index=512, level=0)) <= {"same", "reference"}
    assert '<p class="busy" id="busy">Not comparable' in (tmp_path / "ab.html").read_text()
    # both busy; and a regression among the comparable points still fails as one
    both = run_dir(tmp_path, "c", sweep(busy_at=(512,), half=0.02))
    assert compare.main([b, both, "--out", str(tmp_path / "bb.html")]) == 3
    assert "(A and B busy)" in capsys.readouterr().out
    slow = run_dir(tmp_path, "slow", sweep(busy_at=(512,), slow_at=(64,)))
    assert compare.main([a, slow, "--out", str(tmp_path / "slow.html")]) == 1


def test_compare_of_no_matched_point_is_not_a_pass(tmp_path, capsys):
    a = run_dir(tmp_path, "a", sweep(lengths=(64, 128)))
    b = run_dir(tmp_path, "b", sweep(lengths=(256,)))
    assert compare.main([a, b, "--out", str(tmp_path / "ab.html")]) == 3
    out = capsys.readouterr().out
    assert "nothing compared: A and B share no point (6 only in A, 3 only in B" in out
    assert "compared 0 of 0 matched points" in out


def test_the_ratio_reads_one_way_in_the_text_the_lines_and_the_chart(tmp_path, capsys):
    """B 1.2x slower (relative to its nn.MHA): ratio 1.2, said as B's time over A's."""
    a, b = run_dir(tmp_path, "a", sweep()), run_dir(tmp_path, "b", sweep(fused=1.0))
    assert compare.main([a, b, "--out", str(tmp_path / "ab.html")]) == 1
    out = capsys.readouterr().out
    assert f"ratio = {compare.RATIO_WORDS['speedup']}; above 1: B is slower" in out
    assert compare.RATIO_WORDS["speedup"].startswith("B's time / A's time")
    fused = read_csv(tmp_path / "ab.csv").query("variant == 'fused'")
    assert (fused["ratio"].round(6) == 1.2).all()
    assert compare.RATIO_WORDS["speedup"] in (tmp_path / "ab.html").read_text().replace(
        "&#39;", "'"
    )


def test_a_busy_machine_whose_rounds_stayed_clean_is_said_and_its_figures_stand():
    clean = sweep().assign(busy_cores=1.0, cores=2, contended_rounds=[3] + [0] * 11)
    line = busy_line(clean)
    assert line.startswith("the machine was busy: other processes used 1.0 of 2 cores")
    assert "the 3 repetitions it spoiled were re-timed in clean rounds" in line
    assert line.endswith("so the figures stand.")
    quiet = sweep().assign(busy_cores=0.1, cores=2, contended_rounds=0)
    assert busy_line(quiet) == ""


def test_compare_says_cannot_tell_where_an_interval_is_too_wide_for_the_threshold(tmp_path, capsys):
    """Issue 72: an interval that reaches past 1 +- threshold cannot see a change of the
    threshold's size: "cannot tell (+-N%)", never "same", and no pass (exit 3)."""
    a = run_dir(tmp_path, "a", sweep(half=0.15))
    b = run_dir(tmp_path, "b", sweep(half=0.15))
    assert compare.main([a, b, "--out", str(tmp_path / "ab.html")]) == compare.EXIT_NOT_COMPARABLE
    out = capsys.readouterr().out
    ab = read_csv(tmp_path / "ab.csv")
    ways = ab[ab["variant"] != "reference"]["verdict"]
    assert ways.str.match(r"cannot tell \(\u00b1\d+%\)").all(), ways.tolist()
    assert "same" not in set(ways)
    assert "compared 4 of 12 matched points (8 cannot tell, 4 reference)" in out
    assert compare.main([a, b, "--threshold", "0.5", "--out", str(tmp_path / "w.html")]) == 0


def test_a_points_console_line_says_its_figures_were_timed_busy():
    """Issue 72: `ok ... 1.54x nn.MHA [1.4, 1.69]` read as a result; a contended row says so."""
    from harness.progress import result_line

    busy = row("fused", 1.54, seq_len=64, n_samples=8, contended=True)
    quiet = row("fused", 1.54, seq_len=64, n_samples=8, contended=False)
    assert "busy: timed on a busy machine, these figures decide nothing" in result_line(busy)
    assert "busy" not in result_line(quiet)
