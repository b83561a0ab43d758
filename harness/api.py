"""The Python API: check or time a module against nn.MultiheadAttention without the command line.

    from harness import assert_matches, time_it, verify

    def test_my_attention_is_a_drop_in():
        assert_matches(MyAttention, mask="causal", mode="fwd_bwd", dtype="bfloat16", bias=False)

``variant`` is a class (defined at the top level of an importable module), its dotted path, or
the name of a file in conf/variant. ``keys`` are config keys (docs/reference.md), ``variant`` the
constructor's options (``variant={"attention": "flex"}``), ``timing``/``profiler`` dicts update
their defaults. Each call runs in this process (no worker, no files) and returns the point's row
as a dict with results.csv's columns (docs/reference.md, "Result columns"); ``InvalidPoint`` says
which value is bad, in one line.
"""

from __future__ import annotations

from harness.factory import make_point
from harness.point import run_point

CHECK_COLUMNS = (
    "status",
    "error",
    "check_passed",
    "worst_tensor",
    "max_abs_err",
    "tolerance",
    "ref_err",
    "err_ratio",
    "failed_tensors",
    "diagnosis",
)


def verify(variant, /, **keys) -> dict:
    """Check one point (no timing): the row, with ``status`` ok or why not (``mismatch``,
    ``unsupported``, ...) and the check's columns (``check_passed``, ``max_abs_err``,
    ``tolerance``, ``worst_tensor``...). Never raises for a failed check."""
    return run_point(make_point(variant, **{**keys, "check_only": True}))


def assert_matches(variant, /, **keys) -> dict:
    """``verify``, raising AssertionError with the row's own words unless its status is ok."""
    row = verify(variant, **keys)
    if row["status"] != "ok":
        shown = ", ".join(
            f"{k}={_short(row.get(k))}" for k in CHECK_COLUMNS[2:] if row.get(k) not in (None, "")
        )
        raise AssertionError(
            f"{row['status']}: {row.get('error')}" + (f" ({shown})" if shown else "")
        )
    return row


def _short(value) -> str:
    """A column's value as the message quotes it: a float to 3 significant digits, as the row's
    error words it (max_abs_err=2.11, not 2.1069628139962595)."""
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def time_it(variant, /, **keys) -> dict:
    """Check and time one point in rounds paired with nn.MultiheadAttention at the same shape:
    the row, with ``latency_ms_median`` and ``speedup`` and their 95% intervals
    (``*_ci_low``/``*_ci_high``). Back-to-back rounds in this process: an interval here sees only
    these seconds; a sweep interleaves its points (docs/methodology.md)."""
    return run_point(make_point(variant, **{**keys, "check_only": False}))
