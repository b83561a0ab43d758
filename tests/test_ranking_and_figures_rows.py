"""Rankings with intervals, A/B compare, rows that figures and tables must not merge, and peaks
re-measured when beaten."""

import itertools

import pandas as pd
import pytest

from harness.report import compare
from harness.report import figures
from harness.report import findings
from harness.report import ranking
from harness.report import catalogue
from harness.report import render as report
from harness.measure import peakfile, roofline
from harness.results import CONFIG_KEYS, WAY_KEYS
from harness.factory import make_point


def row(label, speedup, half=0.05, **keys):
    base = dict(
        variant=label.split("/")[0],
        label=label,
        status="ok",
        compile="off",
        sdpa_backend="auto",
        batch=2,
        seq_len=128,
        dtype="float32",
        device="cpu",
        mask="none",
        mode="fwd",
        latency_ms_median=1 / speedup,
        latency_ms_ci_low=0.9 / speedup,
        latency_ms_ci_high=1.1 / speedup,
        speedup=speedup,
        speedup_ci_low=speedup * (1 - half),
        speedup_ci_high=speedup * (1 + half),
        noise=half,
        noise_target_met=True,
    )
    base.update(keys)
    if label == "reference":
        base.update(speedup_ci_low=1.0, speedup_ci_high=1.0)
    return base


def test_a_winner_only_when_its_interval_clears_every_other():
    clear = ranking.rank(
        pd.DataFrame([row("reference", 1.0), row("fused/sdpa", 1.8), row("packed/sdpa", 1.3)])
    )
    assert clear["winner"].tolist() == ["fused/sdpa"] and clear["contenders"].tolist() == [
        "fused/sdpa"
    ]
    tied = ranking.rank(
        pd.DataFrame([row("reference", 1.0), row("fused/sdpa", 1.80), row("packed/sdpa", 1.75)])
    )
    assert tied["winner"].tolist() == [""] and tied["contenders"].tolist() == [
        "fused/sdpa;packed/sdpa"
    ]
    assert tied["best_speedup"].tolist() == [1.8] and tied["basis"].tolist() == ["speedup"]


def test_a_tie_of_one_family_names_the_factors_that_win():
    """fused x SDPA with the view and the reshape merge run the same kernels: they always tie,
    so no single way can win, yet "a fused QKV with SDPA" is the answer. Only where the tied
    ways are exactly the ways that share those factors: a slower member breaks the family."""

    def way(structure, attention, merge, speedup):
        return row(
            f"{structure}/attention={attention},merge={merge}",
            speedup,
            variant=structure,
            variant_options=f"attention={attention} merge={merge}",
        )

    ways = [
        row("reference", 1.0),
        way("fused", "sdpa", "view", 3.0),
        way("fused", "sdpa", "reshape", 3.02),
        way("separate", "sdpa", "view", 2.2),
        way("fused", "manual", "view", 1.2),
    ]
    ranked = ranking.rank(pd.DataFrame(ways)).iloc[0]
    assert ranked["winner"] == "" and ranked["winner_factors"] == "structure=fused attention=sdpa"
    assert ranked["tied_factors"] == "merge"
    sentence = findings.fastest_finding(ranking.rank(pd.DataFrame(ways)))
    assert "structure=fused attention=sdpa" in sentence and "merge tie" in sentence
    # compiled, the same factors win, eager: compile=off joins them
    compiled = ways + [way("fused", "sdpa", "view", 2.0) | {"compile": "default"}]
    again = ranking.rank(pd.DataFrame(compiled)).iloc[0]
    assert again["winner_factors"] == "structure=fused attention=sdpa compile=off"
    # the tied ways differ in merge and compile, and a fused SDPA way with neither is slower:
    # "fused with SDPA" does not win as such, no factor is named
    ways[2] = ways[2] | {"compile": "default"}
    broken = ways + [way("fused", "sdpa", "view", 2.0) | {"compile": "default"}]
    again = ranking.rank(pd.DataFrame(broken)).iloc[0]
    assert again["contenders"].count(";") == 1
    assert again["winner_factors"] == "" and again["tied_factors"] == ""


def test_nn_mha_is_not_a_contender_where_it_is_clearly_slower_but_is_where_it_ties():
    slower = ranking.rank(pd.DataFrame([row("reference", 1.0), row("fused/sdpa", 1.7)]))
    assert "reference" not in slower["contenders"][0]
    close = ranking.rank(pd.DataFrame([row("reference", 1.0), row("fused/sdpa", 1.03)]))
    assert close["contenders"][0] == "fused/sdpa;reference" and close["winner"][0] == ""


def test_without_an_interval_a_way_cannot_be_ruled_out_and_without_speedups_latency_ranks():
    no_iv = row("packed/sdpa", 1.1, speedup_ci_low=None, speedup_ci_high=None)
    r = ranking.rank(pd.DataFrame([row("reference", 1.0), row("fused/sdpa", 2.0), no_iv]))
    assert r["contenders"][0] == "fused/sdpa;packed/sdpa"
    rows = [dict(row("fused/sdpa", 2.0), speedup=None), dict(row("packed/sdpa", 1.0), speedup=None)]
    lat = ranking.rank(pd.DataFrame(rows))
    assert lat["basis"][0] == "latency" and lat["winner"][0] == "fused/sdpa"


def test_failed_and_untimed_rows_are_never_ranked():
    r = ranking.rank(
        pd.DataFrame([row("reference", 1.0), row("fused/sdpa", 3.0, status="mismatch")])
    )
    assert r["winner"].tolist() == ["reference"]


# --- A/B compare ----------------------------------------------------------------------------------


def sweep_rows(slow=1.0, ref_ms=1.0, half=0.02):
    rows = []  # +-2% speedups: a ratio of +-3%, within compare's 5% threshold
    for L in (64, 128, 256, 512):
        rows.append(row("reference", 1.0, seq_len=L, latency_ms_median=ref_ms))
        rows.append(row("fused/sdpa", 1.5 / slow, half, seq_len=L))
        rows.append(row("packed/sdpa", 1.4, half, seq_len=L))
    return pd.DataFrame(rows)


def test_compare_does_not_judge_device_time_against_eager_events():
    """A GPU run from before device time (eager events) against one timed from a CUDA graph: the
    figures differ by the method, so the pair is not compared; timed alike, it is."""
    eager = sweep_rows().assign(device="cuda")
    graph = sweep_rows(slow=1.3).assign(device="cuda", timed_by="graph")
    pairs, _ = compare.compare(eager, graph, 0.05)
    ways = pairs[pairs["variant"] != "reference"]
    assert set(ways["verdict"]) == {"not compared (timed by events / graph)"}
    pairs, _ = compare.compare(eager.assign(timed_by="graph"), graph, 0.05)
    fused = pairs[pairs["label_a"] == "fused/sdpa"]
    assert set(fused["verdict"]) == {"regression"}


def test_compare_passes_identical_results_and_fails_a_slowed_way(tmp_path, capsys):
    a, b, slow = tmp_path / "a.csv", tmp_path / "b.csv", tmp_path / "slow.csv"
    sweep_rows().to_csv(a, index=False)
    sweep_rows(ref_ms=1.25).to_csv(
        b, index=False
    )  # the machine got 25% slower: nothing else changed
    sweep_rows(slow=1.2).to_csv(slow, index=False)
    assert compare.main([str(a), str(b), "--out", str(tmp_path / "ab.html")]) == 0
    out = capsys.readouterr().out
    ab = pd.read_csv(tmp_path / "ab.csv")
    assert (ab.loc[ab["variant"] != "reference", "verdict"] == "same").all(), out
    assert (ab.loc[ab["variant"] == "reference", "verdict"] == "reference").all()
    assert "median 1.250" in out  # nn.MHA's own raw ratio is reported, not gated
    assert compare.main([str(a), str(slow), "--out", str(tmp_path / "slow.html")]) == 1
    s = pd.read_csv(tmp_path / "slow.csv")
    assert (s.loc[s["variant"] == "fused", "verdict"] == "regression").all()
    assert (s.loc[s["variant"] == "packed", "verdict"] == "same").all()
    assert s["ratio"].round(3).isin([1.0, 1.2]).all() and set(compare.CSV_COLUMNS) <= set(s.columns)
    assert (
        compare.main([str(a), str(b), "--basis", "latency", "--out", str(tmp_path / "lat.html")])
        == 1
    )


def test_compare_without_intervals_uses_the_threshold():
    old = pd.DataFrame([dict(variant="fused", status="ok", latency_ms_median=1.0, seq_len=8)])
    pairs, _ = compare.compare(old, old.assign(latency_ms_median=1.04), 0.05)
    assert pairs["verdict"].tolist() == ["same"] and pairs["basis"].tolist() == ["latency"]
    pairs, _ = compare.compare(old, old.assign(latency_ms_median=1.10), 0.05)
    assert pairs["verdict"].tolist() == ["regression"]


# --- report honesty: nothing averages rows that differ in a configuration key --------------------

CHANGED = {
    "variant": "packed",
    "variant_options": "attention=manual",
    "compile": "default",
    "sdpa_backend": "math",
    "batch": 4,
    "seq_len": 256,
    "kv_seq_len": 99,
    "embed_dim": 512,
    "num_heads": 8,
    "dtype": "bfloat16",
    "device": "cuda",
    "mask": "causal",
    "mask_format": "additive",
    "mode": "fwd_bwd",
    "cross": True,
    "shared_kv": True,
    "bias": False,
    "need_weights": True,
    "average_attn_weights": False,
    "seed": 1,
    "num_threads": 1,
    "kv_cache": "concat",
    "kv_cache_len": 1024,
    "num_kv_heads": 2,
    "window": 64,
    "position_bias": "alibi",
    "documents": 4,
    "sinks": True,
    "page_size": 4,
    "qk_norm": "head",
    "qk_norm_eps": 1e-5,
    "rotary": "half",
    "rotary_theta": 500000.0,
    "rotary_fraction": 0.5,
    "rotary_scaling": "yarn",
    "rotary_factor": 4.0,
    "rotary_original": 8192,
    "kv_lora_rank": 4,
    "q_lora_rank": 6,
    "latent_rope_dim": 2,
    "latent_v_dim": 4,
}


def base_rows():
    rows = []
    for L, label in itertools.product((64, 128), ("reference", "fused/attention=sdpa,merge=view")):
        rows.append(
            row(
                label,
                1.0 if label == "reference" else 1.5,
                seq_len=L,
                kv_seq_len=L,
                variant_options="" if label == "reference" else "attention=sdpa merge=view",
                embed_dim=256,
                num_heads=4,
                mask_format="bool",
                cross=False,
                bias=True,
                need_weights=False,
                average_attn_weights=True,
                seed=0,
                num_threads=2,
                tflops=0.1,
                pct_of_peak=50.0,
                peak_mem_mb=1.0,
            )
        )
    return rows


def test_every_configuration_key_is_known_to_the_test():
    assert set(CHANGED) == set(CONFIG_KEYS)


@pytest.mark.parametrize("key", CONFIG_KEYS)
def test_no_figure_or_table_merges_rows_that_differ_in(key):
    rows = base_rows()
    changed = [dict(r, **{key: CHANGED[key]}) for r in rows]
    if key in ("variant", "variant_options"):  # a different way is a different label
        for r in changed:
            r["label"] = f"{r['label']}+{key}"
    df = report.prepare(pd.DataFrame(rows + changed))
    ok = report.timed_ok(df)
    laid = figures.plan(ok, "seq_len", "latency_ms_median")  # refuses rows that share a mark
    # every row drawn, but a configuration at one seq_len: no line (seq_len=256 against keys of
    # 64 and then 128 tokens)
    lone = len(changed) if key == "seq_len" else 0
    assert sum(len(g) for _, g in laid.groups) == len(ok) - lone
    n_shapes = 2 if key in WAY_KEYS else 4
    assert len(ranking.rank(df)) == n_shapes == df["shape"].nunique()
    center, low, high, _ = catalogue.speedups(df)
    assert center.notna().sum().sum() == len(df)  # one cell per row, none averaged


def test_a_figure_refuses_to_average_a_duplicated_configuration():
    df = report.prepare(pd.DataFrame(base_rows() * 2))
    with pytest.raises(ValueError, match="average"):
        figures.lines(report.timed_ok(df), "seq_len", "latency_ms_median", "?", "ms", "L")


def test_latency_figures_draw_each_split_configuration(tmp_path):
    """Keys that vary together (bias and seed) get a panel each, titled by the first and by the
    one it brings along; no panel holds both."""
    rows = base_rows()
    rows += [dict(r, bias=False, seed=1) for r in base_rows()]
    df = report.prepare(pd.DataFrame(rows))
    laid = figures.plan(report.timed_ok(df), "seq_len", "latency_ms_median")
    assert laid.enc.col == "bias" and laid.enc.row is None and len(laid.groups) == 1
    _, panels = figures._panels(laid.groups[0][1], laid.enc)
    assert [(t, sorted(p["seed"].unique())) for t, p in panels] == [
        ("bias=False", [1]),
        ("bias=True", [0]),
    ]
    drawn = figures.lines(
        report.timed_ok(df), "seq_len", "latency_ms_median", "?", "ms", "L", interval=None
    )
    assert len(drawn) == 1 and drawn[0].lines == 2  # the way and nn.MultiheadAttention


# --- % of peak never above 100 ---------------------------------------------------------------


def test_a_point_that_beats_the_peak_is_remeasured_then_becomes_the_peak(tmp_path, monkeypatch):
    measured, asked = iter([(1.0, "torch.mm 512x512 NN"), (1.1, "torch.mm 512x512 NN")]), []
    monkeypatch.setattr(
        roofline,
        "measured_peak",
        lambda device, dtype, only=None: asked.append(only) or next(measured),
    )
    book = roofline.PeakBook(tmp_path / "peak.json")
    p = make_point("fused", batch=1, seq_len=8, embed_dim=16, num_heads=2, device="cpu")
    assert book.get(p) == 1.0
    assert (
        book.beaten(p, 1.05, "fused at B=1") == 1.1
    )  # re-measured: the new peak is above the point
    assert asked == [None, "torch.mm 512x512 NN"]  # every matmul, then the one that won, again
    assert book.beaten(p, 1.5, "fused at B=1") == 1.5  # still beaten: the point's rate is the peak
    entry = next(iter(roofline.json.loads((tmp_path / "peak.json").read_text()).values()))
    assert entry["source"] == "achieved by fused at B=1"
    rows = pd.DataFrame(
        [
            dict(
                device_name=roofline.PeakBook.key(p).split(" | ")[0],
                device="cpu",
                dtype="float32",
                tflops=1.5,
                peak_tflops=1.0,
                pct_of_peak=150.0,
            )
        ]
    )
    assert peakfile.apply_peaks(rows, tmp_path / "peak.json")["pct_of_peak"].tolist() == [100.0]


def test_a_re_measurement_times_only_the_matmul_that_won():
    one = roofline.measured_peak("cpu", roofline.torch.float32, only="torch.mm 512x512 NT")
    assert one[0] > 0 and one[1] == "torch.mm 512x512 NT"
    assert roofline.measured_peak("cpu", roofline.torch.float32, only="torch.mm 9x9 NT")[
        1
    ].startswith("torch.mm ")


def ranked_of(bests: list[tuple[str, float]]) -> pd.DataFrame:
    """ranking.csv's columns the fastest finding reads: one shape per (best way, its speedup)."""
    return pd.DataFrame(
        [
            dict(
                shape=f"L={64 * (i + 1)}",
                best=b,
                best_speedup=s,
                winner="",
                n_ways=5,
                contenders=f"{b};other",
            )
            for i, (b, s) in enumerate(bests)
        ]
    )


def test_the_fastest_finding_singles_out_no_way_that_won_one_shape_of_several():
    """Four shapes, a different best at each: no way "has the highest speedup at 1 of 4 shapes"
    (the first of a tie of counts); nn.MultiheadAttention best at its shapes is named by its
    title, without "1.00x nn.MultiheadAttention's speed"."""
    ways = ["reference", "fused/attention=sdpa", "packed/attention=sdpa", "separate/attention=flex"]
    said = findings.fastest_finding(ranked_of(list(zip(ways, (1.0, 1.5, 3.1, 2.0)))))
    assert said.startswith("the fastest way differs by shape (4 ways for 4 shapes")
    assert "1.00x-3.10x nn.MultiheadAttention's speed" in said and "reference" not in said
    itself = findings.fastest_finding(ranked_of([("reference", 1.0), ("reference", 1.0)]))
    assert itself.startswith(
        "nn.MultiheadAttention has the highest speedup at 2 of 2 shapes (no way measured there "
        "beat it)"
    )
    assert "1.00x" not in itself
    two = findings.fastest_finding(ranked_of([("fused/attention=sdpa", 1.5)] * 2 + [("x", 1.2)]))
    assert two.startswith("fused/attention=sdpa has the highest speedup at 2 of 3 shapes, 1.50x")
