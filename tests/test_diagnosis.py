"""A mismatch names its cause (harness/way/mistakes.py, harness/way/diagnose.py).

Every known mistake, computed as a module would (float32, bfloat16), is named, and a second name
beside it only where that mistake computes the very same thing at the point. A correct module is
never named, even when asked directly. The localisation points at heads, rows, keys and steps
where independent wrong modules (tests/negative/) put their error. The gallery's own names are in
tests/test_negative.py; the CLI's and the API's words in test_cli.py and test_api.py.
"""

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harness import features

from harness.way.build import build_variant
from harness.way.capabilities import variant_class
from harness.way import checks
from harness.way.calls import collect
from harness.way.compared import compared_rows, grouped
from harness.way.diagnose import Failed, Where, name_mistakes, spans, which
from harness.way.mistakes import CATALOGUE, Math, by_name
from harness.factory import make_point
from harness.way.inputs import make_inputs, make_reference
from harness.point import Shelf, run_point
from tests.conftest import REPO
from harness.api import verify
from variants.fused import FusedQKVMHA

NEGATIVE = REPO / "tests" / "negative"
sys.path.insert(0, str(NEGATIVE))  # the gallery's modules

SHAPE = dict(batch=2, seq_len=6, embed_dim=24, num_heads=4, device="cpu", check_only=True)
# Points that between them let every mistake of the catalogue show (bias, masks of each kind,
# cross-attention with L != S, grouped K/V heads, a window, a decode step, gradients).
POINTS = [
    dict(mode="fwd_bwd"),  # no mask
    dict(mask="causal", mode="fwd_bwd"),
    dict(mask="padding", mode="fwd_bwd"),
    dict(mask="causal", cross=True, kv_seq_len=9, mode="fwd_bwd"),
    dict(num_kv_heads=2, mask="causal", mode="fwd_bwd"),
    dict(kv_cache_len=5, seq_len=2),
    dict(kv_cache_len=4, seq_len=2, mask="padding", need_weights=True),
    # each model feature's (harness/features/: ALiBi, sinks, packed documents, the paged cache,
    # the window), where its mistakes show
    *(example for feature in features.registry() for example in feature.examples),
]


def tensors(point, module, inputs64):
    """The module's tensors at the point, as the check collects them."""
    grad = point.mode == "fwd_bwd"
    state = {k: v.to(point.torch_dtype) for k, v in make_reference(point).state_dict().items()}
    inputs = inputs64.to("cpu", point.torch_dtype, grad)
    return grouped(point, collect(module, module, inputs, point.mode, state))


def judged(point, got):
    """The check of ``got`` and what ``name_mistakes`` says about it."""
    reference, inputs64 = make_reference(point), make_inputs(point)
    state = {k: v.to(point.torch_dtype) for k, v in reference.state_dict().items()}
    ys = Shelf().at(point)
    oracle = ys.oracle(point, inputs64, reference)
    ref = ys.reference(point, reference, inputs64, state)
    check = checks.compare(got, ref, oracle, point.dtype)
    return check, name_mistakes(
        Failed(point, reference, inputs64, got, check, oracle, compared_rows(point))
    )


def planted(point, entry):
    """``entry`` computed by a module in the point's dtype: nn.MHA's math with that step wrong."""
    module = Math(make_reference(point), point, entry).to(point.torch_dtype)
    return tensors(point, module, make_inputs(point))


@pytest.mark.parametrize("fields", POINTS, ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()))
# bfloat16 too (about a minute here) in make test-slow and CI
@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.slow)])
def test_every_known_mistake_is_named_where_it_shows(fields, dtype):
    point = make_point("fused", **{**SHAPE, **fields, "dtype": dtype})
    shown, wrong = 0, []
    for entry in CATALOGUE:
        if not entry.applies(point):
            continue
        check, found = judged(point, planted(point, entry))
        if check.passed:  # computes the right thing here (a dropped bias of zero, ...)
            continue
        if not torch.isfinite(planted(point, entry)["out"]).any():
            continue  # NaN everywhere (a fully masked column's softmax over the queries): it
            # matches any other all-NaN output, so nothing is named by design
        shown += 1
        names = [m.mistake.name for m in found.matches]
        if entry.name not in names:
            wrong.append(f"{entry.name}: named {names or 'none'} ({check.worst.name})")
        # a second name only where it is the very same function at this point
        wrong += [
            f"{entry.name}: also named {n}, which computes something else here"
            for n in names
            if n != entry.name and not _same(point, entry.name, n)
        ]
    assert shown >= 10 and not wrong, "\n".join(wrong)


def test_every_known_mistake_applies_at_one_of_the_points_above():
    points = [make_point("fused", **{**SHAPE, **fields}) for fields in POINTS]
    assert [m.name for m in CATALOGUE if not any(m.applies(p) for p in points)] == []


def _same(point, a: str, b: str) -> bool:
    mistakes = by_name()
    ta = planted(dataclasses.replace(point, dtype="float32"), mistakes[a])
    tb = planted(dataclasses.replace(point, dtype="float32"), mistakes[b])
    return all(torch.allclose(ta[k], tb[k], atol=1e-5, equal_nan=True) for k in ta)


CORRECT = [
    ("fused", {}),
    ("fused", {"attention": "manual", "merge": "reshape"}),
    ("separate", {"attention": "flex"}),
    ("packed", {"attention": "manual"}),
    ("reference", {}),
]
# where the structures cannot go: latent attention's two forms (variants/latent.py)
LATENT = [
    ("latent", {}),
    ("latent", {"attention": "manual", "merge": "reshape"}),
    ("latent", {"form": "absorbed"}),
    ("latent", {"form": "absorbed", "attention": "flex"}),
    ("reference", {}),
]


@pytest.mark.parametrize("fields", POINTS, ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()))
def test_a_correct_module_is_never_named_even_when_asked(fields, eager_flex):
    """The diagnosis runs on mismatches only; asked about a correct module anyway (its check
    passed: each structure, each kernel that runs here), no mistake of the catalogue is within
    tolerance of it: each that shows at the point is further from nn.MHA than a correct module
    can be."""
    named = []
    ways = LATENT if fields.get("kv_lora_rank") else CORRECT
    for (name, options), dtype in zip(ways * 2, ["float32"] * 5 + ["bfloat16"] * 5):
        point = make_point(name, **{**SHAPE, **fields, "dtype": dtype}, variant=options)
        if point.kv_cache_len is not None and name == "reference":
            continue
        if options.get("attention") == "flex" and point.mode == "fwd_bwd":
            continue  # FlexAttention has no backward on CPU
        reference = make_reference(point)
        module = build_variant(point, reference, variant_class(point.variant))
        got = tensors(point, module, make_inputs(point))
        check, found = judged(point, got)
        assert check.passed, (name, options, dtype, check.worst)
        if found.matches:
            named.append(f"{name} {options} {dtype}: {[m.mistake.name for m in found.matches]}")
    assert not named, named


def test_an_example_module_is_never_diagnosed():
    """examples/ are correct: their rows carry no diagnosis (they pass), and asked directly no
    mistake matches them (examples/mine.py: attention written from scratch, no biases)."""
    for fields in POINTS[:3]:
        point = make_point("examples.mine.MyAttention", **{**SHAPE, **fields, "bias": False})
        row = run_point(point)
        assert row["status"] == "ok" and not row.get("diagnosis"), row.get("error")
        module = build_variant(point, make_reference(point), variant_class(point.variant))
        check, found = judged(point, tensors(point, module, make_inputs(point)))
        assert check.passed and not found.matches, [m.mistake.name for m in found.matches]


def check(name, **fields):
    point = make_point(f"mistakes.{name}", **{**SHAPE, **fields})
    return run_point(point)


@pytest.mark.parametrize(
    "module, fields, name",
    [
        ("CacheReadFirst", dict(kv_cache_len=5, seq_len=1), "cache_before_own_keys"),
        ("WindowOneNarrow", dict(mask="sliding", window=3), "window_one_narrow"),
        ("DecodeTopLeft", dict(kv_cache_len=5, seq_len=3), "causal_top_left"),
    ],
)
def test_decode_and_window_mistakes_written_elsewhere_are_named(module, fields, name):
    """Modules written with the variants' own kernels and caches (tests/negative/mistakes.py),
    not from the catalogue's steps."""
    for dtype in ("float32", "bfloat16"):
        options = {"attention": "sdpa", **({"window": 3} if "window" in fields else {})}
        row = check(module, dtype=dtype, variant=options, **fields)
        assert row["status"] == "mismatch" and row["diagnosis"] == name, row["error"]


def test_a_wrong_second_decode_step_is_located_there():
    # counts a step's tokens one short when it commits them: the first step is right
    row = check("CacheEarly", kv_cache_len=8, seq_len=1, variant={"attention": "sdpa"})
    assert row["status"] == "mismatch" and row["failed_tensors"] == "step2_out"
    assert row["wrong_in"] == "second_step"
    assert "Where: the first decode step matches; the second" in row["error"]


def test_key_positions_from_the_attention_weights_and_the_key_gradients():
    # causal unapplied: every key above the diagonal is wrongly seen; row 5 (the last) sees all
    row = check("MaskNotApplied", mask="causal", need_weights=True)
    assert row["wrong_keys"] == "1-5" and row["wrong_rows"] == "0-4"
    assert "key positions 1-5 of 6 (attn_weights: seen or hidden against" in row["error"]
    # cross-attention, padding unapplied: the padded keys' gradients (batch 0 pads key 8, batch
    # 1 keys 6-8) are not zero
    row = check("MaskNotApplied", mask="padding", cross=True, kv_seq_len=9, mode="fwd_bwd")
    assert row["diagnosis"] == "masks_ignored"
    assert row["wrong_keys"] == "6-8" and "(grad_key: seen or hidden" in row["wrong_where"]


def test_one_wrong_head_is_located_in_every_dtype():
    for dtype in ("float32", "float16", "bfloat16"):
        row = check("OneHeadUnscaled", dtype=dtype)
        assert row["status"] == "mismatch"
        assert row["wrong_heads"] == "2", (dtype, row["wrong_where"])
        assert "head 2 of 4" in row["error"] and row["diagnosis"] == "none"


def test_a_shape_error_is_said_as_such():
    where = Where(problem="out shape (2, 6, 12), expected (2, 6, 24)")
    assert where.sentence() == "Where: out shape (2, 6, 12), expected (2, 6, 24)."
    row = check("HalfOutput")
    assert row["status"] == "mismatch" and "Where: out shape (2, 6, 12)" in row["error"]


def test_spans_and_counts_read_as_words():
    assert spans([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8"
    assert which("query row", [5, 6, 7], 8) == "query rows 5-7 of 8"
    assert which("query row", [3], 8) == "query row 3 of 8"
    assert which("head", [0, 1, 2, 3], 4) == "all 4 heads"


def test_a_mistake_is_one_function_in_one_place():
    """Adding a mistake is the function and its decorator in harness/way/mistakes.py: the
    catalogue, the names and the reference page (docs/reference.md, generated) follow."""
    names = [m.name for m in CATALOGUE]
    assert len(names) == len(set(names)) and len(names) >= 30
    reference = (REPO / "docs" / "reference.md").read_text()
    assert [n for n in names if f"| `{n}` |" not in reference] == []
    source = (REPO / "harness" / "way" / "mistakes.py").read_text()
    # every entry says what the module computes and how to fix it
    assert all(m.says and m.fix for m in CATALOGUE)
    assert source.count("@mistake(") + source.count("mistake(\n") >= 25


def test_the_guides_worked_example_runs_as_written(tmp_path):
    """docs/guide.md, "From a mismatch to the fix": its two commands, run as written (from a
    directory holding the repository's tests/, where their results and reports go), print what
    the guide shows ("..." stands for numbers that vary) and exit 1, then 0 once fixed."""
    guide = (REPO / "docs" / "guide.md").read_text()
    section = guide.split("### From a mismatch to the fix", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"```bash\n(.*?)```", section, re.S)
    shown = re.findall(r"```text\n(.*?)```", section, re.S)
    assert len(commands) == 2 and len(shown) == 1
    (tmp_path / "tests").symlink_to(REPO / "tests")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}

    def run(command):
        done = subprocess.run(
            ["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True
        )
        return done.returncode, done.stdout + done.stderr

    code, out = run(commands[0])
    assert code == 1, out[-2000:]
    for line in shown[0].strip().splitlines():
        for piece in line.split("..."):
            assert piece.strip() in out, (piece, out[-3000:])
    code, out = run(commands[1])
    assert code == 0, out[-2000:]


class NoOutProj(FusedQKVMHA):  # returns the heads' concatenation (issue 59's example)
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.out_proj.forward = lambda x: x  # its weights still load


class NoInProj(FusedQKVMHA):  # attends over the inputs themselves
    def project(self, query, key, value):
        return self.split_heads(query), self.split_heads(key), self.split_heads(value)


@pytest.mark.parametrize("module, named", [(NoOutProj, "out_proj_skipped"),
                                           (NoInProj, "in_proj_skipped")])  # fmt: skip
def test_a_module_that_leaves_a_step_out_is_named_for_it(module, named):
    row = verify(module, **SHAPE, mask="causal", mode="fwd_bwd")
    assert row["status"] == "mismatch" and row["diagnosis"] == named, row["diagnosis"]
