"""A row's outcome is decided in one place (harness/outcome.py): one precedence rule, and no
other module writes ``status`` or ``error`` (a record's ``Outcome`` part)."""

import ast

import pytest

from harness.outcome import OK, Outcome, Verdict, decide, noted, settled
from tests.conftest import REPO


def test_the_first_failure_speaks_and_a_later_one_is_added_to_it():
    got = settled(Outcome(), OK)
    assert (got.status, got.error) == ("ok", "")
    got = settled(got, Verdict("mismatch", "out: max_abs_err=0.3 > tolerance=0.01"))
    got = settled(got, Verdict("error", "RuntimeError: boom in a timed call"))
    assert got.status == "mismatch"
    assert got.error == (
        "out: max_abs_err=0.3 > tolerance=0.01; then error: RuntimeError: boom in a timed call"
    )
    assert settled(got, OK).status == "mismatch"  # ok never hides a failure


def test_a_death_speaks_whatever_came_before():
    assert decide(Verdict("mismatch", "wrong"), Verdict("crashed", "SIGSEGV")).status == "crashed"
    assert decide(Verdict("timeout", "hung"), Verdict("crashed", "x")).status == "timeout"
    assert decide(None, Verdict("invalid", "seq_len=-1")) == Verdict("invalid", "seq_len=-1")


def test_a_note_keeps_the_status_and_is_added_once():
    got = settled(Outcome(), Verdict("error", "illegal memory access"))
    got = noted(noted(got, "; the worker was restarted"), "; the worker was restarted")
    assert got == Outcome("error", "illegal memory access; the worker was restarted")
    assert noted(Outcome(), "; restarted").error == "restarted"


def test_a_status_outside_the_list_is_refused():
    with pytest.raises(ValueError):
        Verdict("restart")


def test_status_and_error_are_assigned_in_one_module():
    """No module but harness/outcome.py assigns a row's status or error (``row["status"] = ``,
    ``row.update(status=...)``, a dict literal with a "status" key, ``Outcome(status=...)`` or
    ``replace(outcome, error=...)``)."""
    writers = []
    for path in sorted((REPO / "harness").rglob("*.py")):
        if path.name == "outcome.py" or "report" in path.parts:  # the report reads them
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            keys = []
            if isinstance(node, ast.Assign):
                keys = [
                    t.slice.value
                    for t in node.targets
                    if isinstance(t, ast.Subscript) and isinstance(t.slice, ast.Constant)
                ]
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "update":
                keys = [k.arg for k in node.keywords]
            elif isinstance(node, ast.Call) and (
                getattr(node.func, "attr", getattr(node.func, "id", "")) in ("replace", "Outcome")
            ):
                keys = [k.arg for k in node.keywords]
            elif isinstance(node, ast.Dict):
                keys = [k.value for k in node.keys if isinstance(k, ast.Constant)]
            if {"status", "error"} & set(keys):
                writers.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not writers, writers
