"""The attention models ship today: grouped-query heads (num_kv_heads), decode steps against a KV
cache (kv_cache_len, kv_cache=static|concat|paged) and sliding windows (mask=sliding, window), each
checked against nn.MultiheadAttention, refused in one line where it makes no sense, counted by
the work models, and swept by sweep=llm. The mistakes each must catch are in test_negative.py."""

from __future__ import annotations

import itertools

import pandas as pd
import pytest
import torch

from harness.config import InvalidPoint, Point
from harness.features.window import hidden as window_hidden
from harness.way.inputs import make_reference, not_seen
from harness.flops import decode_bytes, mha_flops, pairs_seen
from harness.way.footprint import footprint
from harness.measure.roofline import PeakBook
from harness.point import run_point
from harness.factory import make_point
from tests.conftest import run_harness

SMALL = dict(batch=2, seq_len=6, embed_dim=32, num_heads=4, device="cpu", check_only=True)
KERNELS = ("manual", "sdpa", "flex")


def check(name: str, attention: str | None = None, **fields) -> dict:
    variant = {} if attention is None else {"attention": attention}
    return run_point(make_point(name, **{**SMALL, "variant": variant, **fields}))


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(num_kv_heads=3), "num_kv_heads=3 does not divide num_heads=4"),
        (dict(num_kv_heads=0), "num_kv_heads=0 must be a positive integer"),
        (dict(kv_cache_len=8, cross=True), "kv_cache_len=8 with cross=true"),
        (dict(kv_cache_len=8, mode="fwd_bwd"), "kv_cache_len=8 with mode=fwd_bwd"),
        (dict(kv_cache_len=8, kv_seq_len=3), "kv_seq_len=3: it is kv_cache_len + seq_len"),
        (dict(kv_cache_len=-1), "kv_cache_len=-1 must be a positive integer"),
        (dict(kv_cache="concat"), "kv_cache=concat applies to decode points only"),
        (
            dict(kv_cache="ring", kv_cache_len=4),
            "kv_cache='ring' is not one of static|concat|paged",
        ),
        (dict(kv_cache_len=4, page_size=4), "page_size=4 applies to kv_cache=paged only"),
        (dict(mask="sliding"), "mask=sliding needs window=W"),
        (dict(window=4), "window=4 applies to mask=sliding only"),
        (dict(mask="sliding", window=0), "window=0 must be a positive integer"),
        (dict(mask="sliding", window=4, cross=True), "mask=sliding with cross=true"),
    ],
)
def test_bad_values_are_refused_in_one_line_naming_them(fields, message):
    with pytest.raises(InvalidPoint) as e:
        Point(**{"device": "cpu", "num_heads": 4, **fields})
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_bad_value_on_the_command_line_exits_2_with_its_line(tmp_path):
    r = run_harness("num_kv_heads=3", "device=cpu", cwd=tmp_path)
    assert r.returncode == 2
    assert "num_kv_heads=3 does not divide num_heads=4" in r.stderr


def test_a_model_nn_mha_cannot_express_is_refused_with_why_not_a_near_key(tmp_path):
    """Tanh softcapping has no nn.MHA expression, so no oracle (issue 59): refused on the
    command line and in the API, in one line that says so; DeepSeek's names of latent
    attention's sizes say which keys are theirs."""
    r = run_harness("softcap=30", "device=cpu", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0, r.stderr
    assert "softcap is not a config key: tanh softcapping" in r.stderr
    assert "no oracle checks it: unsupported" in r.stderr
    with pytest.raises(InvalidPoint, match=r"^v_head_dim is not a config key: .* latent_v_dim"):
        make_point("fused", v_head_dim=64)


def test_decode_resolves_the_key_length_and_causality():
    p = Point(device="cpu", seq_len=2, kv_cache_len=10)
    assert (p.kv_seq_len, p.mask, p.num_kv_heads) == (12, "causal", p.num_heads)
    assert Point(device="cpu", num_heads=8, num_kv_heads=2).groups == 4


@pytest.mark.parametrize("name", ["separate", "fused", "packed"])
def test_every_structure_and_kernel_matches_nn_mha(name, eager_flex):
    """Grouped heads, decode (both cache styles, one and several new tokens) and windows, each
    alone and together, in float32 and bfloat16: every hand-written way passes its check."""
    cases = [
        dict(num_kv_heads=2),
        dict(num_kv_heads=1, mask="causal", mode="fwd_bwd"),
        dict(num_kv_heads=2, mask="padding", cross=True, kv_seq_len=5),
        dict(kv_cache_len=9, seq_len=1),
        dict(kv_cache_len=9, seq_len=3, num_kv_heads=2, kv_cache="concat"),
        dict(mask="sliding", window=3),
        dict(mask="sliding", window=2, num_kv_heads=1, mask_format="additive"),
        dict(kv_cache_len=7, seq_len=3, mask="sliding", window=4, num_kv_heads=2),
    ]
    failed = []
    for kernel, case, dtype in itertools.product(KERNELS, cases, ("float32", "bfloat16")):
        if kernel == "flex" and case.get("mode") == "fwd_bwd":
            continue  # no FlexAttention backward on the CPU (test_negative checks the refusal)
        row = check(name, kernel, dtype=dtype, **case)
        if row["status"] != "ok":
            failed.append(f"{kernel} {dtype} {case}: {row['status']} {row['error']}")
    assert not failed, "\n".join(failed)


def test_nn_mha_runs_the_same_math_and_says_what_ran():
    gqa = check("reference", num_kv_heads=2)
    assert gqa["status"] == "ok" and gqa["num_kv_heads"] == 2
    decode = check("reference", kv_cache_len=9, seq_len=1)
    assert decode["status"] == "ok" and decode["kv_cache"] == "none"  # recomputes the prefix
    concat = check("reference", kv_cache_len=9, seq_len=1, kv_cache="concat")
    assert concat["status"] == "unsupported" and "has no KV cache" in concat["error"]
    cached = check("fused", "sdpa", kv_cache_len=9, seq_len=1, kv_cache="concat")
    assert cached["status"] == "ok" and cached["kv_cache"] == "concat"


def test_grouped_weights_load_only_when_they_repeat_per_group():
    point = Point(device="cpu", embed_dim=32, num_heads=4, num_kv_heads=2)
    grouped = make_reference(point).state_dict()
    k = grouped["in_proj_weight"][32:64].view(4, 8, 32)
    assert torch.equal(k[0], k[1]) and torch.equal(k[2], k[3]) and not torch.equal(k[1], k[2])
    from variants.fused import FusedQKVMHA

    module = FusedQKVMHA(32, 4, num_kv_heads=2).double()
    module.load_state_dict(grouped)
    assert module.in_proj.weight.shape == (32 + 2 * 16, 32)
    plain = make_reference(Point(device="cpu", embed_dim=32, num_heads=4)).state_dict()
    with pytest.raises(ValueError, match="do not repeat in groups of 2"):
        FusedQKVMHA(32, 4, num_kv_heads=2).double().load_state_dict(plain)


def test_a_variant_without_grouped_heads_is_unsupported_not_wrong(tmp_path):
    row = run_point(
        make_point(
            "fused",
            **{**SMALL, "num_kv_heads": 2},
            variant={"_target_": "tests.negative.textbook.Textbook"},
        )
    )
    assert row["status"] == "unsupported" and "takes no num_kv_heads" in row["error"]


def test_work_models_count_what_each_feature_saves():
    # pairs a query sees: counted by brute force from the masks the harness builds
    for L, S, window in [(6, 6, 3), (1, 9, None), (3, 10, None), (3, 10, 4), (8, 8, 1)]:
        hidden = not_seen(L, S) if window is None else window_hidden(L, S, window)
        seen = L * S - (0 if hidden is None else int(hidden.sum()))
        assert pairs_seen(L, S, True, window, cached=S - L) == seen
    assert pairs_seen(8, 4, True) == 16  # causal prefill or cross: half, the convention
    full = mha_flops(2, 64, 64, 256, False, "fwd")
    grouped = mha_flops(2, 64, 64, 256, False, "fwd", kv_frac=0.25)
    assert full - grouped == pytest.approx(2 * 2 * 64 * 256 * 256 * 2 * 0.75)  # K and V
    # decode: the cached tokens' K/V are not projected again; the attention grows with P
    step = mha_flops(1, 1, 1025, 256, True, "fwd", cached=1024)
    assert step == pytest.approx(2 * 1 * 256 * 256 * 2 + 2 * 256 * 256 * 2 + 4 * 1025 * 256)
    # bytes: the cache dominates at long P, and grouping divides it
    b8 = decode_bytes(1, 1, 32768, 4096, 1.0, False, 2)
    b1 = decode_bytes(1, 1, 32768, 4096, 1 / 32, False, 2)
    assert b8 > 4 * 32768 * 4096 and b1 < b8 / 4
    # memory: the variant's K/V weights and activations are Hkv heads wide; nn.MHA's are not
    point = Point(device="cpu", embed_dim=256, num_heads=8, num_kv_heads=2, seq_len=64)
    mine, full = footprint(point, False), footprint(point, False, grouped=False)
    assert full.weights - mine.weights == 2 * 256 * 192 + 2 * 192  # K, V rows and biases
    assert full.activations - mine.activations == 2 * 2 * 64 * 192


def test_decode_rows_have_bandwidth_against_a_measured_copy():
    peaks = PeakBook()
    fields = dict(SMALL, check_only=False, kv_cache_len=64, seq_len=1)
    fields["timing"] = dict(rounds=2, round_time=0.002, warmup=0.002)
    row = run_point(make_point("fused", **fields), peaks)
    assert row["status"] == "ok", row["error"]
    assert row["bytes_per_call"] > 0 and row["gbps"] > 0 and row["copy_gbps"] > 0
    assert row["pct_of_copy_bw"] == pytest.approx(100 * row["gbps"] / row["copy_gbps"])
    prefill = run_point(make_point("fused", **{**fields, "kv_cache_len": None}), peaks)
    assert prefill["bytes_per_call"] is None and prefill["gbps"] is None


@pytest.fixture(scope="module")
def llm_sweep(tmp_path_factory):
    """sweep=llm as users run it (74 points, about 25 s: the points' own overhead, smaller shapes
    save nothing), for the tests that read its rows and its report."""
    tmp_path = tmp_path_factory.mktemp("llm")
    tiny = [
        "batch=1",
        "embed_dim=32",
        "num_heads=8",
        "timing.warmup=0.001",
        "timing.rounds=3",
        "timing.round_time=0.002",
        "num_threads=1",  # two threads stall each other on a busy machine (tests/conftest.py)
    ]
    r = run_harness(
        "-m", "sweep=llm", "device=cpu", f"hydra.sweep.dir={tmp_path / 's'}", *tiny, cwd=tmp_path
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r, tmp_path


@pytest.mark.slow  # the llm preset swept once (30-45 s here): make test-slow and CI run it
def test_the_llm_preset_runs_its_three_sweeps_as_one(llm_sweep):
    """sweep=llm: prefill x K/V heads, a window, decode x cache lengths x cache styles (a union,
    not a product); its findings state the K/V-head, window, cache and decode effects."""
    r, tmp_path = llm_sweep
    df = pd.read_csv(tmp_path / "s" / "results.csv")
    decode = df[df["kv_cache_len"].notna()]
    prefill = df[df["kv_cache_len"].isna()]
    assert len(prefill) == 20 and len(decode) == 54  # 3 x 5 + 5; 3 x 3 x (2 x 2 + 1 + 1)
    assert set(prefill["seq_len"]) == {512} and set(decode["seq_len"]) == {1}
    assert (decode["status"] == "unsupported").sum() == 9  # nn.MHA has no cache to concatenate
    assert (df["status"] == "ok").sum() == 65
    assert set(decode.loc[decode["status"] == "ok", "kv_cache"]) == {"static", "concat", "none"}
    effects = pd.read_csv(tmp_path / "s" / "effects.csv")
    assert {"num_kv_heads", "kv_cache", "mask", "attention"} <= set(effects["factor"])
    said = [line for line in r.stdout.splitlines() if line.startswith("finding: ")]
    for factor in ("num_kv_heads", "kv_cache", "mask", "decode"):
        assert any(line.startswith(f"finding: {factor}: ") for line in said), said


@pytest.mark.slow  # the llm preset swept once (30-45 s here): make test-slow and CI run it
def test_the_llm_report_draws_decode_grouped_heads_and_the_window(llm_sweep, chromium):
    """In a real browser: sweep=llm's report has figures along the cache length (latency, and
    GB/s under the copy bandwidth), the K/V heads and the window, none along seq_len (a single
    length per configuration: said, not drawn as single points)."""
    _, tmp_path = llm_sweep
    chromium.set_window_size(1280, 900)
    chromium.get((tmp_path / "s" / "report.html").as_uri())
    images = chromium.execute_script(
        "return [...document.images].map(i => [i.dataset.x, i.alt,"
        " i.getBoundingClientRect().width, i.complete && i.naturalWidth > 0])"
    )
    along = [x for x, *_ in images if x]
    assert along.count("kv_cache_len") == 2, images  # latency and GB/s
    assert "num_kv_heads" in along and "attends" in along and "seq_len" not in along
    assert all(ok and shown >= 600 for _, _, shown, ok in images), images
    decode = chromium.execute_script(
        "return document.querySelector('#decode') !== null"
        " && [...document.querySelectorAll('img')].some(i => i.alt.includes('copy bandwidth'))"
    )
    assert decode
    links = chromium.execute_script(
        "return [...document.querySelectorAll('#findings li')]"
        ".filter(li => li.textContent.startsWith('decode'))"
        ".map(li => li.querySelector('a').getAttribute('href'))"
    )
    assert links == ["#decode"]  # the decode finding points at its figures
