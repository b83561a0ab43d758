"""The check's verdict per way, for the top of the console's last lines and of the report: "does
my module compute what nn.MultiheadAttention computes, and if not, what do I fix?"

One ``Verdict`` per way (variant with its options and compile mode, in sweep order): how many of
its points passed, and its failures grouped by what they say, each group once with its count,
the diagnosis in words, the fix and where the error is (the first failing point's: a group's
points share a diagnosis), and the points it failed at. Points the machine could not run
(``unsupported``, ``oom``) are grouped by the first line of their reason, cut short at a word
(the line whole in ``full``; the whole text in the row and in errors.log): they have no error to
locate. nn.MultiheadAttention is named so (ways.way_name), as the findings and figures name it.

Torch-free: pandas only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import pandas as pd

from harness.outcome import CHECK_FAILURES
from harness.progress import case, first_line
from harness.report.ways import way_name
from harness.results import distinct, way


def _text(value) -> str:
    return "" if value is None or value != value else str(value).strip()


@dataclass
class Group:
    """Points of one way that failed, or could not run, saying the same thing."""

    status: str
    says: str  # the diagnosis in words, or the reason's first line
    fix: str = ""
    where: str = ""
    worst: str = ""  # the first point's worst tensor, its error and tolerance
    full: str = ""  # the reason's first line uncut (``says`` may be cut short)
    cases: list[str] = field(default_factory=list)  # the points (progress.case)
    said: list[str] = field(default_factory=list)  # each point's words (numbers may differ)

    @property
    def words(self) -> str:
        """What the group says, its numbers as ranges where its points differ."""
        return _numbers_merged(self.said) if len(set(self.said)) > 1 else self.says

    @property
    def reason(self) -> str:
        """What the report's table cell (it wraps) says: the reason's first line to
        ``REASON_SHORT`` characters where its points said the same, else ``words``."""
        if not self.full or len(set(self.said)) > 1:
            return self.words
        return first_line(self.full, REASON_SHORT)


@dataclass
class Verdict:
    way: str
    points: int = 0
    passed: int = 0
    failed: list[Group] = field(default_factory=list)  # CHECK_FAILURES, by what they say
    limits: list[Group] = field(default_factory=list)  # unsupported, oom: the machine's limits

    @property
    def n_failed(self) -> int:
        return sum(len(g.cases) for g in self.failed)

    @property
    def word(self) -> str:
        """fails | passes | not run: the verdict in a word."""
        if self.failed:
            return "fails"
        return "passes" if self.passed else "not run"


def _worst(row: dict) -> str:
    """ "grad_query: error 7.41 > tolerance 4.79e-05" for a row whose check ran."""
    tensor, err, tol = (row.get(k) for k in ("worst_tensor", "max_abs_err", "tolerance"))
    if not _text(tensor) or err != err or tol != tol or err is None or tol is None:
        return ""
    return f"{tensor}: error {float(err):.3g} > tolerance {float(tol):.3g}"


def _says(row: dict) -> Group:
    """A failed row's group: its diagnosis where the check ran, else its error's first line."""
    status, error = str(row.get("status")), _text(row.get("error"))
    where = _text(row.get("wrong_where")).removeprefix("Where: ").rstrip(".")
    says = _text(row.get("diagnosis_says"))
    if status == "mismatch" and not says:  # rows written before the column: the error's words
        said = error.split(" Diagnosis: ")
        says = first_line((said[1] if len(said) > 1 else error).split(" Where: ")[0])
    if status != "mismatch":
        return _reason(status, error)
    return Group(status, says, _text(row.get("diagnosis_fix")), where, _worst(row))


def _reason(status: str, error: str) -> Group:
    """A group of points that did not run (or failed without a diagnosis): their reason's first
    line, cut short, and whole (``full``)."""
    return Group(status, first_line(error), full=first_line(error, len(error)))


def _words(says: str) -> str:
    """What a diagnosis says with its numbers left out: "none of the 22 known mistakes" and
    "none of the 27 known mistakes" (fewer mistakes show at some points) are one diagnosis."""
    return re.sub(r"\d+(\.\d+)?", "#", says)


def _numbers_merged(texts: list[str]) -> str:
    """One text for texts that differ only in their numbers: each number that differs as its
    range ("none of the 22-27 known mistakes")."""
    parts = [re.split(r"(\d+(?:\.\d+)?)", t) for t in texts]
    out = []
    for i, piece in enumerate(parts[0]):
        if i % 2 == 0:
            out.append(piece)
            continue
        values = sorted({float(p[i]) for p in parts}, key=float)
        shown = [f"{v:g}" for v in values]
        out.append(shown[0] if len(shown) == 1 else f"{shown[0]}-{shown[-1]}")
    return "".join(out)


def _group(groups: list[Group], new: Group, at: str) -> None:
    """``new`` joins the group of its way that says the same (numbers aside), else starts one: a
    way's "none of the known mistakes" is one line with its true count (issue 73: 12 failures
    read as "8 of 12" and "4 of 12" on two lines)."""
    for g in groups:
        if g.status == new.status and _words(g.says) == _words(new.says):
            g.cases.append(at)
            g.said.append(new.says)
            return
    new.cases.append(at)
    new.said.append(new.says)
    groups.append(new)


def verdicts(df: pd.DataFrame) -> list[Verdict]:
    """One verdict per way of ``df`` (every row of a run), in the order the ways first ran."""
    if df.empty or "status" not in df.columns:
        return []
    out: dict[str, Verdict] = {}
    for row in distinct(df).to_dict("records"):
        name = way_name(way(row))
        v = out.setdefault(name, Verdict(name))
        v.points += 1
        status = str(row.get("status"))
        if status == "ok":
            v.passed += 1
        elif status in CHECK_FAILURES:
            _group(v.failed, _says(row), case(row))
        else:
            _group(v.limits, _reason(status, _text(row.get("error"))), case(row))
    return list(out.values())


def cases_said(cases: list[str], shown: int = 2) -> str:
    """ "B=2 L=16 ... mask=none; B=2 L=16 ... mask=causal and 2 more"."""
    more = f" and {len(cases) - shown} more" if len(cases) > shown else ""
    return "; ".join(cases[:shown]) + more


def lines(table: list[Verdict]) -> list[str]:
    """The console's lines: a line per failing group (``check failed:``), per group the
    machine could not run (``unsupported:``/``oom:``), and one for the ways that passed."""
    out = []
    for v in table:
        for g in v.failed:
            points = "point" if v.points == 1 else "points"
            text = f"check failed: {v.way}: {g.status} at {len(g.cases)} of {v.points} {points}: "
            text += g.words
            text += f"; fix: {g.fix}" if g.fix else ""
            text += f"; worst: {g.worst}" if g.worst else ""
            text += f"; where: {g.where}" if g.where else ""
            out.append(text + f" (at {cases_said(g.cases)})")
    for v in table:
        for g in v.limits:
            out.append(
                f"{g.status}: {v.way} at {len(g.cases)} of {v.points} "
                f"point{'' if v.points == 1 else 's'}: {g.says} "
                "(the whole text: errors.log)"
            )
    good = [v for v in table if v.word == "passes" and not v.limits]
    if good:
        names = ", ".join(v.way for v in good[:6]) + (
            f" and {len(good) - 6} more" if len(good) > 6 else ""
        )
        ways = "way" if len(good) == 1 else "ways"
        out.append(f"check passed: {len(good)} {ways} at every point: {names}")
    return out


def report_rows(df: pd.DataFrame) -> dict:
    """The report's opening table: a row per group of failing points of a way,
    then per group the machine could not run, then each way that passed everywhere (one row
    for all of them past ``PASSED_ROWS`` ways); and the counts its summary line says."""
    table = verdicts(df)
    rows = []
    for v in table:  # the failures first, then what the machine could not run
        rows += [{"way": v.way, "points": v.points, "group": g, "word": g.status} for g in v.failed]
    for v in table:  # ``limit``: no error to locate, only the points it happened at
        rows += [
            {"way": v.way, "points": v.points, "group": g, "word": g.status, "limit": True}
            for g in v.limits
        ]
    good = [v for v in table if v.word == "passes" and not v.limits]
    if len(good) <= PASSED_ROWS:
        rows += [{"way": v.way, "points": v.points, "group": None, "word": "passes"} for v in good]
    elif good:
        names = ", ".join(v.way for v in good)
        rows.append({"way": f"{len(good)} ways", "points": sum(v.points for v in good),
                     "group": None, "word": "passes", "names": names})  # fmt: skip
    failing = [v for v in table if v.failed]
    return {"rows": rows, "ways": len(table), "failing": len(failing), "passing": len(good)}


REASON_SHORT = 320  # characters of a reason the report's verdict table shows (the console: 160)
PASSED_ROWS = 12  # past this many ways that pass everywhere, the verdict names them in one row
