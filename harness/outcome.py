"""A row's outcome, decided in one place: its ``status`` and ``error`` (docs/guide.md, "When
something goes wrong: statuses, exit codes, refusals").

Every stage of a point says what it found as a ``Verdict``, in the order the point ran: admitted
or not, the check (at unit scale, repeated, at activation scale, in float32), the calls after it
(warm-up, probe, profile, the rounds, the re-check), the worker's fate. ``settle`` is the only
code that writes the two columns, by one precedence rule:

1. The worker's death speaks last and loudest: ``crashed`` or ``timeout`` is the row's status
   whatever came before (the point never finished; its other columns keep what it had).
2. Otherwise the first verdict that is not ``ok`` speaks: a check that failed already says why,
   and a later failure (a call after it that raised) is added to its error, not put in its place.
3. ``ok`` only while nothing failed.

``note`` adds to the error without changing the status (a restarted worker, a changed torch).

Ground module: it imports nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

STATUSES = ("ok", "mismatch", "oom", "unsupported", "invalid", "error", "crashed", "timeout")
DEATHS = ("crashed", "timeout")  # the worker died or hung: rule 1


@dataclass(frozen=True)
class Verdict:
    status: str
    error: str = ""

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"Verdict: status {self.status!r} is not one of {STATUSES}")


OK = Verdict("ok")


def decide(first: Verdict | None, then: Verdict) -> Verdict:
    """The precedence rule: the outcome after ``first`` (None: nothing yet) when ``then`` is
    found."""
    if first is None or first.status == "ok":
        return then
    if then.status in DEATHS and first.status not in DEATHS:
        return then
    if then.status == "ok" or not then.error or then.error in first.error:
        return first
    return Verdict(first.status, f"{first.error}; then {then.status}: {then.error}".lstrip("; "))


def of(row: dict) -> Verdict | None:
    """The row's outcome so far (None: nothing decided yet)."""
    status = row.get("status")
    return None if status in (None, "") else Verdict(status, row.get("error") or "")


def settle(row: dict, verdict: Verdict) -> dict:
    """Record ``verdict`` on ``row`` by the precedence rule (in place); the row."""
    decided = decide(of(row), verdict)
    row["status"], row["error"] = decided.status, decided.error
    return row


def note(row: dict, text: str) -> dict:
    """Add ``text`` to the row's error, once, keeping its status."""
    error = row.get("error") or ""
    if text not in error:
        row["error"] = f"{error}{text}" if error else text.lstrip("; .")
    return row
