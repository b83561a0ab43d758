"""The Python API (harness/api.py): what a user's pytest calls instead of the command line."""

import pytest
import torch.nn as nn

import harness
from harness.config import InvalidPoint

SMALL = dict(batch=2, seq_len=8, embed_dim=16, num_heads=2, device="cpu")


class SwappedKV(nn.MultiheadAttention):
    """A plausible bug: key and value exchanged. Same shapes, wrong numbers."""

    def __init__(self, embed_dim, num_heads, bias=True):
        super().__init__(embed_dim, num_heads, bias=bias, batch_first=True)

    def forward(self, query, key, value, **kwargs):
        return super().forward(query, value, key, **kwargs)


def test_a_conf_variant_a_dotted_path_and_a_class_are_checked_alike():
    by_name = harness.verify("fused", **SMALL, mask="causal")
    by_path = harness.verify(
        "variants.fused.FusedQKVMHA", **SMALL, mask="causal", variant={"attention": "manual"}
    )
    assert by_name["status"] == by_path["status"] == "ok"
    assert by_name["label"] == "fused/attention=sdpa,merge=view"
    assert by_path["variant_options"] == "attention=manual"


def test_a_wrong_module_fails_with_the_checks_own_words():
    row = harness.verify(SwappedKV, **SMALL, cross=True, kv_seq_len=5)
    assert row["status"] == "mismatch" and row["check_passed"] is False
    with pytest.raises(AssertionError, match=r"^mismatch: out: max_abs_err=.* > tolerance=") as e:
        harness.assert_matches(SwappedKV, **SMALL, cross=True, kv_seq_len=5)
    # the cause and where it shows, in the message and the row
    assert "Diagnosis: it computes nn.MHA with the key and value inputs swapped" in str(e.value)
    assert "Where: the output differs in all 2 heads" in str(e.value)
    assert "diagnosis=key_value_swapped" in str(e.value) and row["diagnosis"] == "key_value_swapped"
    assert harness.verify(SwappedKV, **SMALL)["status"] == "ok"  # self-attention cannot tell


def test_bad_values_are_one_line_naming_them():
    with pytest.raises(
        InvalidPoint,
        match=r"^mask='diagonal' is not one of none\|causal\|padding\|documents\|sliding$",
    ):
        harness.verify("fused", **SMALL, mask="diagonal")
    with pytest.raises(InvalidPoint, match="is not in conf/variant"):
        harness.verify("nosuch", **SMALL)
    with pytest.raises(InvalidPoint, match="timing.rounds=1 must be an integer >= 2"):
        harness.time_it("fused", **SMALL, timing={"rounds": 1})


def test_the_command_line_does_not_import_torch_through_the_api():
    import subprocess
    import sys

    code = "import harness, harness.cli, sys; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "False"


def test_the_example_drop_in_test_passes():
    """examples/test_dropin.py, run as a user would run their own test file."""
    import subprocess
    import sys

    from tests.conftest import REPO

    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "examples/test_dropin.py"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "9 passed" in proc.stdout
