"""A row's outcome is decided in one place (harness/outcome.py): one precedence rule, and no
other module writes ``status`` or ``error``."""

import ast

import pytest

from harness.outcome import OK, Verdict, decide, note, settle
from tests.conftest import REPO


def test_the_first_failure_speaks_and_a_later_one_is_added_to_it():
    row = settle({}, OK)
    assert (row["status"], row["error"]) == ("ok", "")
    settle(row, Verdict("mismatch", "out: max_abs_err=0.3 > tolerance=0.01"))
    settle(row, Verdict("error", "RuntimeError: boom in a timed call"))
    assert row["status"] == "mismatch"
    assert row["error"] == (
        "out: max_abs_err=0.3 > tolerance=0.01; then error: RuntimeError: boom in a timed call"
    )
    settle(row, OK)  # ok never hides a failure
    assert row["status"] == "mismatch"


def test_a_death_speaks_whatever_came_before():
    assert decide(Verdict("mismatch", "wrong"), Verdict("crashed", "SIGSEGV")).status == "crashed"
    assert decide(Verdict("timeout", "hung"), Verdict("crashed", "x")).status == "timeout"
    assert decide(None, Verdict("invalid", "seq_len=-1")) == Verdict("invalid", "seq_len=-1")


def test_a_note_keeps_the_status_and_is_added_once():
    row = settle({}, Verdict("error", "illegal memory access"))
    note(note(row, "; the worker was restarted"), "; the worker was restarted")
    assert row == {"status": "error", "error": "illegal memory access; the worker was restarted"}
    assert note({}, "; restarted")["error"] == "restarted"


def test_a_status_outside_the_list_is_refused():
    with pytest.raises(ValueError):
        Verdict("restart")


def test_status_and_error_are_assigned_in_one_module():
    """No module but harness/outcome.py assigns a row's status or error (``row["status"] = ``,
    ``row.update(status=...)``, a dict literal with a "status" key)."""
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
            elif isinstance(node, ast.Dict):
                keys = [k.value for k in node.keys if isinstance(k, ast.Constant)]
            if {"status", "error"} & set(keys):
                writers.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not writers, writers
