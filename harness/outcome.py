"""A row's outcome, decided in one place: its ``status`` and ``error`` (docs/guide.md, "When
something goes wrong: statuses, exit codes, refusals").

Every stage of a point says what it found as a ``Verdict``, in the order the point ran: admitted
or not, the check (at unit scale, repeated, at activation scale, in float32), the calls after it
(warm-up, probe, profile, the rounds, the re-check), the worker's fate. ``settled`` is the only
code that decides the two columns (the record's ``Outcome`` part), by one precedence rule:

1. The worker's death speaks last and loudest: ``crashed`` or ``timeout`` is the row's status
   whatever came before (the point never finished; its other columns keep what it had).
2. Otherwise the first verdict that is not ``ok`` speaks: a check that failed already says why,
   and a later failure (a call after it that raised) is added to its error, not put in its place.
3. ``ok`` only while nothing failed.

``noted`` adds to the error without changing the status (a restarted worker).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from harness.column import Part, col

STATUSES = ("ok", "mismatch", "oom", "unsupported", "invalid", "error", "crashed", "timeout")
DEATHS = ("crashed", "timeout")  # the worker died or hung: rule 1
# With check_only=true these statuses fail the run: the check failed or could not run for a
# reason of the variant's own. oom and unsupported are the machine's limits, reported only.
CHECK_FAILURES = ("mismatch", "error", "invalid", "crashed", "timeout")
CHECKED = ("ok", "mismatch")  # statuses of points whose check ran to its verdict


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


@dataclass(frozen=True)
class Outcome(Part):
    """The record's outcome part: its status and error (and what of torch a variant changed),
    written by ``settled`` and ``noted`` alone."""

    status: str | None = col(
        "name",
        "`ok`, `mismatch` (check failed, or not a drop-in), `oom`, `unsupported`, `invalid` "
        "(bad value), `error`, `crashed` (the worker died), `timeout` (over `point_timeout`);"
        ' see "When something goes wrong"',
        table=True,
    )
    error: str | None = col("text", "why, when status is not `ok` (empty otherwise)", table=True)
    torch_changed: str | None = col(
        "names",
        "what of torch the variant's module changed on import (a library that patches torch: "
        "lightning's `torch.compile`) or in its calls (`torch.nn.MultiheadAttention.forward`): "
        "and torch's global switches it set (`torch.float32_matmul_precision=medium`, anomaly "
        "mode): its world, in place for its own calls only (its check and its timed calls), "
        "never for nn.MultiheadAttention's or another point's (harness/fingerprint.py); `a "
        "thread it started (name)` or `a process it started (pid (command))`: not timed, "
        "`unsupported`, the worker replaced (its processes ended with it, harness/processes.py); "
        "empty: nothing",
    )

    @property
    def verdict(self) -> Verdict | None:
        """The outcome so far (None: nothing decided yet)."""
        return None if self.status in (None, "") else Verdict(self.status, self.error or "")


def settled(outcome: Outcome, verdict: Verdict) -> Outcome:
    """``outcome`` once ``verdict`` is found, by the precedence rule."""
    decided = decide(outcome.verdict, verdict)
    return replace(outcome, status=decided.status, error=decided.error)


def noted(outcome: Outcome, text: str) -> Outcome:
    """``outcome`` with ``text`` added to its error, once, its status kept."""
    error = outcome.error or ""
    if text in error:
        return outcome
    return replace(outcome, error=f"{error}{text}" if error else text.lstrip("; ."))
