"""One definition of what a key is: each config key declares its role with its
default (harness/config.py, ``key(role=...)``), and results, compare, the sweeper and the
rounds' shape key are derived from it."""

import dataclasses
import subprocess
import sys

import pandas as pd
import pytest

from harness import verify
from harness.config import ROLES, Point, keys_with
from harness.report import compare
from harness.results import CONFIG_KEYS, SHAPE_KEYS, WAY_KEYS, write_row
from tests.conftest import REPO

SMALL = dict(embed_dim=32, num_heads=4, seq_len=8, batch=2)


def test_every_top_level_key_has_a_role_and_the_lists_follow_it():
    for f in dataclasses.fields(Point):
        assert f.metadata.get("role") in ROLES, f.name
    assert set(SHAPE_KEYS) == set(keys_with("shape", "model", "machine"))
    assert set(WAY_KEYS) == {"variant_options", *keys_with("way")}
    assert {"num_kv_heads", "kv_cache_len", "kv_cache", "window"} <= set(compare.MATCH_KEYS)
    assert "num_threads" not in compare.MATCH_KEYS  # the machine: what an A/B changes
    from hydra_plugins.mha_bench.sweeper import WAY_KEYS as NOT_THE_SHAPE

    assert set(NOT_THE_SHAPE) == set(keys_with("way", "measure", "run"))


def rows(**case) -> list[dict]:
    return [verify("fused", **{**SMALL, **case})]


def test_compare_matches_one_row_to_one_row_with_grouped_heads_decode_and_windows():
    """Two identical sweeps over K/V heads, cache styles and lengths, and windows: compared as
    exactly as many points as one sweep has (grouped heads were cross-joined: 3 points as 9)."""
    points = []
    for hkv in (1, 2, 4):
        points += rows(num_kv_heads=hkv)
    for style in ("static", "concat"):
        for p in (8, 16):
            points += rows(kv_cache_len=p, kv_cache=style, seq_len=1)
    for w in (2, 4):
        points += rows(mask="sliding", window=w)
    a = pd.DataFrame(points)
    assert (a["status"] == "ok").all()
    pairs, only = compare.compare(a, a.copy(), 0.05)
    assert len(pairs) == len(a) == 9 and only.empty


def test_a_stray_column_is_refused_with_its_name(tmp_path):
    row = verify("fused", **SMALL)
    write_row(tmp_path, row)  # the schema's own columns
    with pytest.raises(ValueError, match="'latency_msec' not a column"):
        write_row(tmp_path, {**row, "latency_msec": 1.0})


def test_the_report_reads_results_without_importing_torch(tmp_path):
    """mha-bench report and compare read CSVs: torch (seconds to import) is never needed."""
    # A finder that refuses torch: an import of it fails, and torch never enters sys.modules
    # (a None entry there would break libraries that look torch up to test array types).
    code = (
        "import sys\n"
        "class NoTorch:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch' or name.startswith('torch.'):\n"
        "            raise ImportError('torch is not to be imported here')\n"
        "sys.meta_path.insert(0, NoTorch())\n"
        "from harness.report import render, compare, paired, effects, ranking\n"
        "from harness import cli\n"
        "assert 'torch' not in sys.modules\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_config_keys_are_the_way_and_shape_keys():
    assert CONFIG_KEYS == WAY_KEYS + SHAPE_KEYS


def test_effects_split_each_key_once():
    """A model key (mask) is a shape key and in a pair's context too: split once, not twice
    ("it depends on mask: 0.80x at mask=none, 1.40x at mask=causal, 0.80x at mask=none, ...")."""
    from harness.report.effects import summarize

    pairs = []
    for mask, ratio in (("none", 0.8), ("causal", 1.4)):
        for seq_len in (64, 128):
            pairs.append(
                dict(
                    factor="kernel",
                    baseline="manual",
                    alternative="sdpa",
                    context=f"structure=fused mask={mask}",
                    mask=mask,
                    seq_len=seq_len,
                    ratio=ratio,
                    ratio_ci_low=ratio * 0.95,
                    ratio_ci_high=ratio * 1.05,
                    verdict="faster" if ratio > 1 else "slower",
                    rerun_noise=0.04,
                )
            )
    summary = summarize(pd.DataFrame(pairs))
    keys = ["factor", "baseline", "alternative", "by", "value"]
    assert not summary.duplicated(keys).any(), summary[keys]
    assert set(summary["by"]) == {"all", "mask", "seq_len"}


def test_findings_name_structures_and_kernels_by_their_own_titles(tmp_path):
    """The names in sentences come from the kernel registry and the variant classes (through the
    run's ways.json, which the report reads without torch), not from a copy."""
    from harness.way import kernels
    from harness.sweep.facts import write_ways
    from harness.report import ways as report_ways
    from variants.fused import FusedQKVMHA
    from variants.reference import ReferenceMHA

    rows = pd.DataFrame(
        [
            dict(
                variant="fused",
                variant_target="variants.fused.FusedQKVMHA",
                variant_options="attention=sdpa merge=view",
            ),
            dict(variant="reference", variant_target="variants.reference.ReferenceMHA"),
        ]
    )
    write_ways(tmp_path, rows)
    ways = report_ways.load(tmp_path)
    for name in kernels.builtin():
        assert ways.name("attention", name) == kernels.get(name).title != ""
        assert ways.kernel_order(name) == kernels.get(name).order
    assert ways.name("structure", "fused") == FusedQKVMHA.title
    assert ways.name("structure", "reference") == ReferenceMHA.title
    assert ways.name("attention", "pkg.mine") == "attention=pkg.mine"  # no such module
    # a run without the file (an older one) names its ways by their values, nn.MHA by its own
    bare = report_ways.load(tmp_path / "older")
    assert bare.name("attention", "sdpa") == "attention=sdpa"
    assert bare.name("structure", "reference") == ReferenceMHA.title
    (tmp_path / report_ways.WAYS_FILE).write_text("{not json")
    problems: list[str] = []
    assert report_ways.load(tmp_path, problems) == report_ways.Ways()
    assert len(problems) == 1 and "ways.json: not JSON" in problems[0]


def test_a_kernel_module_that_fails_importing_is_named_by_its_value(tmp_path, monkeypatch):
    """The end of a sweep writes ways.json from the registry: an outside kernel whose module
    raises on import (not only ImportError) is left out, named by its value, never a traceback."""
    from harness.sweep.facts import ways_of

    (tmp_path / "broken_kernel_mod.py").write_text("raise RuntimeError('no device here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    rows = pd.DataFrame(
        [dict(variant="fused", variant_options="attention=broken_kernel_mod merge=view")]
    )
    ways = ways_of(rows)
    assert ways.kernel("broken_kernel_mod") is None and ways.kernel("sdpa") is not None
    assert ways.name("attention", "broken_kernel_mod") == "attention=broken_kernel_mod"
