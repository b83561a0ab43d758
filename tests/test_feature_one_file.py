"""A model feature is one file (issue 69): a made-up feature, a bias on the first key with one
known mistake, added to a git copy of the repository as one module of harness/features/ and its
test, is validated as a config key, swept, checked against nn.MultiheadAttention (handed the bias
in its float mask), its planted mistake named, drawn in the report and listed in the reference;
``git status`` shows those two files alone."""

import os
import subprocess
import sys

import pandas as pd
import pytest

from harness.envinfo import python_env
from tests.conftest import TINY
from tests.test_docs import run_in

FEATURE = r'''"""A bias on the first key, ``first_key_bias=b`` (a made-up model feature, to show
that one is one file; tests/test_feature_one_file.py adds it to a copy of the repository): every
query adds b to its logit for key 0, as a model that favours its first token would.

nn.MultiheadAttention is handed the bias in its float ``attn_mask``; so is any module whose class
does not take ``first_key_bias`` (a module that takes it adds it itself).
"""

from __future__ import annotations

from harness.features import Feature, shown, torch
from harness.keys import key
from harness.validate import number


def bias(b: float, S: int, at: int = 0):
    """(1, 1, S) float64: ``b`` on key ``at``, 0 elsewhere (every head, every query row)."""
    out = torch.zeros(1, 1, S, dtype=torch.float64)
    out[..., at] = b
    return out


class FirstKey(Feature):
    keys = {
        "first_key_bias": key(
            0.0, "b, added to every query's logit for key 0 (0: none)", role="shape", after="sinks"
        )
    }
    steps = {"first_key": ("bias", lambda m, L, S: bias(m.point.first_key_bias, S))}
    handed = 1
    examples = (dict(first_key_bias=2.0), dict(first_key_bias=-1.0, mask="causal"))

    def active(self, point) -> bool:
        return point.first_key_bias != 0

    def check(self, point, set_) -> None:
        number("first_key_bias", point.first_key_bias, -100, below=100, unit="in -100..100")

    def argument(self, point) -> dict:
        return {"first_key_bias": point.first_key_bias}

    def term(self, point, model, L, S, rows=None, like=None):
        if getattr(model, "first_key_bias", 0.0) == point.first_key_bias:
            return None  # it adds the bias itself
        return bias(point.first_key_bias, S)

    def case(self, row: dict) -> str:
        b = shown(row, "first_key_bias", 0.0)
        return "" if b is None else f" first_key={float(b):g}"


FEATURE = FirstKey()


@FEATURE.mistake(
    "first_key",
    "the first key's bias added to the last key",
    "add b to key 0's logit: scores[..., 0] += b",
)
def first_key_on_last(m, L, S):
    return bias(m.point.first_key_bias, S, at=S - 1)
'''

ITS_TEST = r'''"""The made-up first_key feature (harness/features/first_key.py): a module that
applies it is checked against nn.MultiheadAttention handed the bias, and one that puts it on the
last key is a mismatch named for it."""

import math

import torch

from harness.api import verify
from variants.fused import FusedQKVMHA

SHAPE = dict(batch=2, seq_len=8, embed_dim=32, num_heads=4, device="cpu", first_key_bias=3.0)


class OwnBias(FusedQKVMHA):
    """Takes first_key_bias and adds it to key ``at``'s logit itself (through its float mask)."""

    at = 0

    def __init__(self, *args, first_key_bias=0.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.first_key_bias = first_key_bias

    def forward(self, query, key, value, key_padding_mask=None, need_weights=False,
                attn_mask=None, average_attn_weights=True, is_causal=False, kv_cache=None):
        L, S = query.size(1), key.size(1)
        added = torch.zeros(L, S, dtype=query.dtype, device=query.device)
        added[:, self.at if self.at >= 0 else S + self.at] = self.first_key_bias
        if attn_mask is not None:
            given = attn_mask.to(query.dtype)
            if attn_mask.dtype == torch.bool:
                given = torch.zeros_like(added).masked_fill(attn_mask, -math.inf)
            added = added + given
        return super().forward(query, key, value, key_padding_mask, need_weights, added,
                               average_attn_weights, False, kv_cache)


class LastKey(OwnBias):
    at = -1


def test_a_module_that_adds_the_bias_itself_matches_nn_mha():
    for mask in ("none", "causal"):
        row = verify(OwnBias, **SHAPE, mask=mask)
        assert row["status"] == "ok", (mask, row["error"])


def test_the_bias_on_the_last_key_is_a_mismatch_named_for_it():
    row = verify(LastKey, **SHAPE)
    assert row["status"] == "mismatch", row["error"]
    assert row["diagnosis"].split(";") == ["first_key_on_last"], row["diagnosis"]
'''


@pytest.mark.slow  # a copy of the repository, a sweep and a pytest in it (about 40 s here)
def test_a_model_feature_is_one_file_checked_named_and_drawn(copy, tmp_path):
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "copy"]):
        subprocess.run([*git, *args], cwd=copy, check=True, capture_output=True)
    (copy / "harness" / "features" / "first_key.py").write_text(FEATURE)
    (copy / "tests" / "test_first_key.py").write_text(ITS_TEST)
    status = subprocess.run(
        ["git", "status", "--porcelain"], cwd=copy, capture_output=True, text=True, check=True
    ).stdout
    assert sorted(status.splitlines()) == [
        "?? harness/features/first_key.py",
        "?? tests/test_first_key.py",
    ], status

    # its planted mistake named, a module that applies it passing: its own test, in the copy; and
    # the diagnosis's test plants its mistake at its examples, as it does every mistake's
    env = python_env(copy, env=dict(os.environ))
    # "-m": the diagnosis's bfloat16 cases are make test-slow's
    tests = ["tests/test_first_key.py", "tests/test_diagnosis.py", "-k", "first_key or applies"]
    tests += ["-m", "slow or not slow"]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
        cwd=copy, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    # its own 2; its mistake named at its 2 examples in 2 dtypes, no correct module named at
    # either; every mistake applies at one example
    assert "9 passed" in proc.stdout, proc.stdout[-2000:]

    # a bad value is one line; swept, every way checked against nn.MHA and timed
    bad = run_in(copy, "first_key_bias=1e9", "check_only=true", *TINY, "hydra.run.dir=bad")
    assert bad.returncode == 2 and "first_key_bias=1000000000.0 must be" in bad.stderr, bad.stderr
    tiny = [a for a in TINY if not a.startswith("seq_len=")]
    sweep = ["-m", "variant=fused,separate", "first_key_bias=0,3", "seq_len=16,32", *tiny]
    proc = run_in(copy, *sweep, f"hydra.sweep.dir={tmp_path / 's'}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = pd.read_csv(tmp_path / "s" / "results.csv")
    assert sorted(set(rows["first_key_bias"])) == [0, 3] and set(rows["status"]) == {"ok"}
    assert any(" first_key=3 " in line for line in proc.stdout.splitlines())  # its words

    # drawn: every figure draws (strict: a figure that would merge the two biases raises), and
    # the report names the feature's shapes
    code = (
        "import sys; from harness.report.render import render_dir; "
        "render_dir(sys.argv[1], sys.argv[2], strict=True)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "s"), str(tmp_path / "r")],
        cwd=copy, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    html = (tmp_path / "s" / "report.html").read_text()
    assert "first_key=3" in html and 'data-figure="speedup_lines"' in html

    # the reference follows it: its key and its mistake
    assert run_in(copy, module="harness.docs").returncode == 0
    reference = (copy / "docs" / "reference.md").read_text()
    assert "| `first_key_bias` | `0.0` |" in reference and "| `first_key_on_last` |" in reference
