"""Stage-level tests: config validation, results files, timer, checker, report rendering."""

import dataclasses
import time

import pandas as pd
import math

import pytest
import torch

from harness.way import checks
from harness.report import render as report
from harness.config import InvalidPoint, Timing
from harness.point import run_point
from harness.factory import make_point
from harness.results import COLUMNS, find_rows, gather, write_results, write_row
from harness.measure.timing import Window, measure

TINY = dict(
    batch=1,
    seq_len=8,
    embed_dim=16,
    num_heads=2,
    device="cpu",
    timing=dict(warmup=0.001, rounds=3, round_time=0.001),
)


def point(**changes):
    """conf/config.yaml's defaults for the fused variant, tiny, with ``changes``."""
    return make_point("fused", **{**TINY, **changes})


def test_parse_point_types_and_defaults():
    p = point()
    assert (p.head_dim, p.kv_seq_len, p.device, p.torch_dtype) == (8, 8, "cpu", torch.float32)
    assert p.variant.label == "fused/attention=sdpa,merge=view"
    assert point(device="auto").device in ("cpu", "cuda")
    assert point(compile=False).compile == "off"  # YAML 1.1 reads a bare `off` as False


@pytest.mark.parametrize(
    "changes,message",
    [
        (dict(num_heads=3), "embed_dim=16 is not divisible by num_heads=3"),
        (dict(batch=0), "batch=0"),
        (dict(seq_len=2.5), "seq_len=2.5"),
        (dict(dtype="half"), "dtype='half'"),
        (dict(device="gpu"), "device='gpu'"),
        (dict(mask="alibi"), "mask='alibi'"),
        (dict(mode="bwd"), "mode='bwd'"),
        (dict(mask_format="int"), "mask_format='int'"),
        (dict(need_weights="yes"), "need_weights='yes'"),
        (dict(compile="yes"), "compile='yes'"),
        (dict(kv_seq_len=4), "kv_seq_len=4 differs from seq_len=8"),
        (dict(timing=dict(rounds=0)), "timing.rounds=0"),
        (dict(timing=dict(round_time=-1)), "timing.round_time=-1"),
        (dict(timing=dict(resident_mb="lots")), "timing.resident_mb='lots'"),
        (dict(timing=dict(min_time=0.5)), "timing.min_time is not a timing key"),
        (dict(timing=dict(max_noise=2)), "timing.max_noise=2"),
        (dict(timing=dict(warmup_ms=5)), "timing.warmup_ms is not a timing key"),
        (dict(sdpa_backend="fast"), "sdpa_backend='fast'"),
        (dict(num_threads=0), "num_threads=0"),
        # unbounded values (issue 58): refused in one line, not a hang or a check turned off
        (dict(timing=dict(warmup=float("inf"))), "timing.warmup=inf must be"),
        (dict(timing=dict(round_time=float("nan"))), "timing.round_time=nan must be"),
        (dict(timing=dict(round_time=1e6)), "timing.round_time=1000000.0 s is not below"),
        (dict(timing=dict(round_time=1e9)), "timing.round_time=1000000000.0 is too large"),
        (dict(check_max_logit=float("inf")), "check_max_logit=inf must be"),
        (dict(seed=10**20), "seed=100000000000000000000 must be an integer 0"),
        (dict(shared_kv=True), "shared_kv=true is a cross-attention"),
    ],
)
def test_parse_point_rejects_with_the_bad_value(changes, message):
    with pytest.raises(InvalidPoint, match=message.replace("(", r"\(").replace(".", r"\.")):
        point(**changes)


def test_cross_attention_point_runs_and_matches():
    row = run_point(point(cross=True, kv_seq_len=5, mask="causal"))
    assert row["status"] == "ok" and row["check_passed"], row


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_every_dtype_checks_against_the_float64_oracle(dtype):
    row = run_point(point(dtype=dtype))
    assert row["status"] == "ok", row
    assert 0 <= row["max_abs_err"] <= row["tolerance"]
    assert row["ref_err"] > 0  # the oracle is float64, so even nn.MHA in `dtype` has some error


def test_same_seed_same_errors_other_seed_other_errors():
    a, b, c = run_point(point()), run_point(point()), run_point(point(seed=1))
    assert a["max_abs_err"] == b["max_abs_err"] and a["ref_err"] == b["ref_err"]
    assert a["max_abs_err"] != c["max_abs_err"]


def test_checker_flags_nan_shape_and_missing_tensors():
    oracle = torch.ones(2, 3, dtype=torch.float64)
    ref = oracle.float()

    def passed(actual, oracle=oracle, ref=ref):
        return checks.check_tensor("out", actual, ref, oracle, "float32").passed

    assert not passed(torch.full((2, 3), float("nan")))
    assert not passed(torch.ones(3, 2))
    assert passed(oracle.float())
    assert not passed(oracle.float() + 1e-3)
    # NaN where the oracle is NaN too (a fully masked row) is agreement, elsewhere it is not
    nan_row = oracle.clone()
    nan_row[0] = float("nan")
    assert passed(nan_row.float(), oracle=nan_row, ref=nan_row.float())
    assert not passed(oracle.float(), oracle=nan_row, ref=nan_row.float())
    result = checks.compare(
        {"out": ref},
        {"out": ref, "grad_query": ref},
        {"out": oracle, "grad_query": oracle},
        "float32",
    )
    assert not result.passed and result.worst.name == "grad_query"  # missing counts as wrong


def test_tolerance_rule_and_worst_index():
    oracle = torch.zeros(4, 5, dtype=torch.float64)
    ref = oracle.float() + 1e-3  # nn.MHA itself off by 1e-3
    got = oracle.float().clone()
    got[2, 3] = 3.9e-3  # within K * ref_err = 4e-3
    t = checks.check_tensor("out", got, ref, oracle, "float32")
    assert t.passed and t.tolerance == pytest.approx(checks.K * 1e-3) and t.worst_index == (2, 3)
    got[1, 1] = 5e-3
    t = checks.check_tensor("out", got, ref, oracle, "float32")
    assert not t.passed and t.worst_index == (1, 1) and t.err_ratio == pytest.approx(5.0, rel=1e-3)


class Exploding(torch.nn.MultiheadAttention):
    def __init__(self, embed_dim, num_heads, bias=True):
        super().__init__(embed_dim, num_heads, bias=bias, batch_first=True)

    def forward(self, *args, **kwargs):
        raise RuntimeError("kaboom in forward")


def test_failing_variant_becomes_an_error_row_not_a_crash():
    row = run_point(point(variant={"_target_": f"{__name__}.Exploding"}))
    assert row["status"] == "error" and "kaboom in forward" in row["error"]
    assert row["latency_ms_median"] is None  # it failed before timing: nothing made up


def test_variant_with_the_wrong_signature_is_invalid():
    with pytest.raises(InvalidPoint, match="unexpected keyword argument 'embed_dim'"):
        run_point(point(variant={"_target_": "torch.nn.Linear"}))


def test_cuda_point_without_cuda_is_unsupported():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    row = run_point(point(device="cuda"))
    assert row["status"] == "unsupported" and "CUDA is not available" in row["error"]


def test_timer_measures_what_it_is_given():
    result = measure(
        lambda: time.sleep(0.002),
        "cpu",
        Window(warmup=0.001, min_samples=5, min_time=0, max_time=0.03),
    )
    assert 5 <= result.n_samples <= 1000
    assert 2.0 <= result.median_ms < 50
    assert result.iqr_ms >= 0


def test_timer_respects_min_and_max_samples():
    assert (
        measure(lambda: None, "cpu", Window(warmup=0, min_samples=7, max_samples=7)).n_samples == 7
    )
    slow = measure(lambda: time.sleep(0.001), "cpu", Window(warmup=0, min_samples=3, max_time=0))
    assert slow.n_samples == 3


def test_rows_are_atomic_and_gathered_in_job_order(tmp_path):
    for num in (10, 2, 1):
        write_row(tmp_path / str(num), {"variant": f"v{num}", "status": "ok", "seed": num})
    assert not list(tmp_path.rglob("*.tmp"))
    assert [p.parent.name for p in find_rows(tmp_path)] == ["1", "2", "10"]
    path, df = write_results(tmp_path)
    assert list(df["variant"]) == ["v1", "v2", "v10"]
    assert list(df.columns) == COLUMNS  # a stray column is refused (tests/test_key_roles.py)
    assert pd.read_csv(path)["variant"].tolist() == ["v1", "v2", "v10"]


def test_gather_of_nothing_is_an_empty_table(tmp_path):
    assert list(gather(tmp_path).columns) == COLUMNS


def _rows(tmp_path, rows):
    for i, r in enumerate(rows):
        write_row(tmp_path / "sweep" / str(i), r)
    return tmp_path / "sweep"


@pytest.mark.parametrize(
    "rows",
    [
        [],
        [{"variant": "x", "label": "x", "status": "error", "error": "boom"}],
        [
            {
                "variant": "x",
                "label": "x",
                "status": "ok",
                "compile": "off",
                "seq_len": 8,
                "dtype": "float32",
                "mask": "none",
                "latency_ms_median": 0.1,
                "latency_ms_iqr": 0.01,
                "n_samples": 3,
            }
        ],
    ],
    ids=["no rows", "all failed", "one point"],
)
def test_report_renders_degenerate_sweeps(tmp_path, rows):
    root = _rows(tmp_path, rows)
    html = report.render_dir(root, report_dir=tmp_path / "reports", strict=True)
    text = html.read_text()
    assert html == tmp_path / "reports" / f"{tmp_path.name}-sweep.html"
    results = text[text.index('id="results"') :]
    assert results.count("<tr") == len(rows) + 1  # header plus one per row
    # a single point is no line: the figures say so rather than draw a lone dot
    assert "data:image/png;base64," not in text
    timed = any("latency_ms_median" in r for r in rows)
    assert ("the sequence length? (one seq_len in the sweep)" in text) == timed


def test_report_cli_rerenders_from_files(tmp_path, capsys):
    root = _rows(tmp_path, [{"variant": "x", "label": "x", "status": "ok"}])
    write_results(root)
    assert report.main([str(root), "--report-dir", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith("report: ") and (tmp_path / "r").is_dir()
    assert report.main([str(tmp_path / "missing")]) == 2


def test_one_small_compile_point():
    """One compile test only (each costs tens of seconds on 2 cores): forward and backward."""
    p = point(compile="default", mode="fwd_bwd", mask="padding")
    row = run_point(dataclasses.replace(p, timing=Timing(warmup=0.001, rounds=3, round_time=0.001)))
    assert row["status"] == "ok" and row["check_passed"], row
    assert row["compile_s"] > 0 and row["compiled_graphs"] >= 1  # first call, compile included
    assert row["recompiles"] == 0  # steady state compiles nothing


def test_each_compiled_point_compiles_its_own_static_graph_whatever_ran_before():
    """In one process (a sweep's worker) Dynamo shares a class's graphs between instances: the
    third shape reused a dynamic graph compiled for the second, without compiling (0 graphs)."""
    quick = Timing(warmup=0.001, rounds=2, round_time=0.001)
    for L in (8, 12, 16, 8):
        row = run_point(dataclasses.replace(point(compile="default", seq_len=L), timing=quick))
        assert row["status"] == "ok", row["error"]
        assert row["compiled_graphs"] >= 1 and row["compiled_shapes"] == "static", (L, row)
        assert row["recompiles"] == 0


def test_the_reference_documents_every_column_config_key_and_preset():
    """docs/reference.md (generated) has every column and key; the guide names every preset."""
    from harness.config import defaults
    from tests.conftest import REPO

    reference = (REPO / "docs" / "reference.md").read_text()
    assert [c for c in COLUMNS if f"`{c}`" not in reference] == []
    keys = [
        f"{k}.{n}" if isinstance(v, dict) else k
        for k, v in defaults().items()
        for n in (v if isinstance(v, dict) else [None])
    ]
    assert keys and [k for k in keys if f"`{k}`" not in reference] == []
    guide = (REPO / "docs" / "guide.md").read_text()
    presets = [p.stem for p in (REPO / "conf" / "sweep").glob("*.yaml")]
    assert [p for p in presets if f"`{p}`" not in guide] == []


@pytest.mark.parametrize("digest", ["83924815253808e9", "0123456789012345"])
def test_hashes_that_look_like_numbers_stay_text_and_their_rows_are_gathered(tmp_path, digest):
    """pandas reads "83924815253808e9" as 8.39e22 and "0123..." as an int: such a row would no
    longer match its job's hash (found: one row of a 192-point sweep left out, exit 3)."""
    from harness.results import read_csv, write_jobs

    write_row(
        tmp_path / "0",
        {
            "variant": "fused",
            "status": "ok",
            "config_hash": digest,
            "variant_source_hash": digest[:12],
        },
    )
    write_jobs(tmp_path, {str(tmp_path / "0"): digest})
    problems = []
    df = gather(tmp_path, problems)
    assert problems == [] and list(df["config_hash"]) == [digest]
    write_results(tmp_path)
    assert read_csv(tmp_path / "results.csv")["variant_source_hash"].iloc[0] == digest[:12]


def test_the_sweep_summary_adds_up_what_compiling_cost():
    from harness.sweep.callbacks import compile_summary

    rows = pd.DataFrame(
        {"compile_s": [2.0, None, 3.5], "compiled_graphs": [1, None, 2], "recompiles": [0, None, 1]}
    )
    assert compile_summary(rows) == (
        ", 2 first calls compiled 3 graphs in 5.5 s (column compile_s), "
        "1 recompilations while timed"
    )
    assert compile_summary(rows.assign(compile_s=None)) == ""  # nothing compiled: nothing said


def test_a_point_that_compiled_says_so_on_its_progress_line():
    from harness.progress import result_line

    row = dict(
        status="ok",
        label="fused/attention=flex,merge=view",
        batch=2,
        seq_len=16,
        embed_dim=16,
        num_heads=2,
        dtype="float32",
        device="cpu",
        mask="causal",
        compile_s=7.84,
    )
    assert "compiled 7.84 s" in result_line(row)
    assert "compiled" not in result_line({**row, "compile_s": float("nan")})  # pandas' empty cell


def test_the_ways_of_one_shape_run_together_whatever_the_override_order():
    """The float64 oracle is kept for consecutive points of one shape (point.oracle_tensors):
    the sweeper puts them together however the user ordered the overrides."""
    from hydra_plugins.mha_bench.sweeper import shapes_together

    jobs = [
        [f"variant={v}", f"variant.attention={a}", f"seq_len={L}", "compile=off"]
        for v in ("fused", "separate")
        for a in ("manual", "sdpa")
        for L in (128, 512)
    ]
    ordered = shapes_together(jobs)
    assert sorted(map(tuple, ordered)) == sorted(map(tuple, jobs))  # the same jobs
    shapes = [job[2] for job in ordered]
    assert shapes == ["seq_len=128"] * 4 + ["seq_len=512"] * 4  # in the order they first appear
    ways = [tuple(job[:2]) for job in ordered[:4]]
    assert ways == [
        ("variant=fused", "variant.attention=manual"),
        ("variant=fused", "variant.attention=sdpa"),
        ("variant=separate", "variant.attention=manual"),
        ("variant=separate", "variant.attention=sdpa"),
    ]  # ways keep their order
    assert shapes_together([["seed=1", "+timing.rounds=3"], ["seed=0"]]) == [
        ["seed=1", "+timing.rounds=3"],
        ["seed=0"],
    ]


def test_rerun_noise_is_by_device_unless_set():
    """A CPU's between-run noise is not a GPU's: null is the device kind's earned floor
    (config.rerun_floor, harness/floors.json), a value the user sets wins, and a noise target
    below the floor is refused whichever it is."""
    from harness.config import rerun_floor

    assert point().timing.rerun_noise is None and rerun_floor("cpu")[1] in ("earned", "assumed")
    assert point(device="cuda:1", timing=dict(rerun_noise=0.01)).timing.rerun_noise == 0.01
    assert point(device="cuda", timing=dict(max_noise=0.05)).timing.max_noise == 0.05  # floor 3.9%
    least = math.sinh(1.959964 * rerun_floor("cpu")[0])
    below = round(least * 0.9, 4)
    with pytest.raises(InvalidPoint, match=rf"timing.max_noise={below} can never be met with"):
        point(device="cpu", timing=dict(max_noise=below))
    with pytest.raises(
        InvalidPoint, match=r"timing.max_noise=0.05 can never be met with timing.rerun_noise=0.04"
    ):
        point(device="cpu", timing=dict(max_noise=0.05, rerun_noise=0.04))


@pytest.mark.parametrize(
    "changes",
    [
        dict(mask="causal", mode="fwd_bwd"),
        dict(mask="padding", mode="fwd_bwd", cross=True, kv_seq_len=11),
        dict(mask="causal", mask_format="additive", need_weights=True, average_attn_weights=False),
        dict(mask="none", mode="fwd_bwd", need_weights=True),
        # fwd: the key and value projected once for every block (collect.keys_projected_once)
        dict(mask="padding", cross=True, kv_seq_len=11, need_weights=True),
        dict(mask="causal", num_kv_heads=2, need_weights=True),
    ],
)
def test_the_oracle_in_query_blocks_is_the_whole_one(changes):
    """nn.MultiheadAttention in float64 run on blocks of query rows gives the same output,
    weights and every gradient as run on the whole query (harness/way/calls.py)."""
    from harness.way.calls import collect
    from harness.way.calls import collect_in_blocks
    from harness.way.inputs import make_inputs, make_reference

    p = point(seq_len=13, **changes)
    model = make_reference(p)
    grad = p.mode == "fwd_bwd"
    whole = collect(
        model, model, make_inputs(p).to("cpu", torch.float64, grad), p.mode, model.state_dict()
    )
    blocks = collect_in_blocks(
        model, make_inputs(p).to("cpu", torch.float64, grad), p.mode, model.state_dict(), rows=4
    )
    assert set(blocks) == set(whole) and len(whole) >= 2
    for name in whole:
        torch.testing.assert_close(blocks[name], whole[name], rtol=1e-12, atol=1e-12, msg=name)
