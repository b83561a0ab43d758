"""What a run's report needs of its ways, read from their own definitions when the run ends: each
attention kernel's ``Kernel`` entry (harness/way/kernels.py: title, scores, order, memory) and each
structure's class ``title``, written as ways.json beside env.json (harness/report/ways.py reads
it, torch-free). So a kernel is one file: a new one, built in or outside the repository, reaches
the report of every run that ran it, and nothing committed is regenerated for it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Callable

import yaml

from harness.way import kernels
from harness.report.ways import WAYS_FILE, Ways
from harness.results import factors
from harness.files import atomic_write_text

if TYPE_CHECKING:
    import pandas as pd


# The built-in structures: the variant config group's files (name -> class path)
VARIANTS = Path(__file__).resolve().parents[2] / "conf" / "variant"


def ways_of(rows: pd.DataFrame, read: Callable | None = None) -> Ways:
    """The titles and kernel facts of every built-in structure and kernel, and of each one
    ``rows`` ran (an outside kernel by its module path; one that no longer imports is left
    out: the report names it by its value). ``read`` reads their definitions (``definitions``,
    which imports each, and torch): the sweep asks its worker, which has them imported."""
    records = rows.to_dict("records") if len(rows) else []
    builtin = [
        {"variant": p.stem, "variant_target": yaml.safe_load(p.read_text()).get("_target_")}
        for p in sorted(VARIANTS.glob("*.yaml"))
    ]
    named = dict.fromkeys(kernels.builtin())
    named.update(dict.fromkeys(f["attention"] for f in map(factors, records) if "attention" in f))
    classes = dict.fromkeys(
        (r.get("variant"), r.get("variant_target"))
        for r in [*builtin, *records]
        if isinstance(r.get("variant"), str) and isinstance(r.get("variant_target"), str)
    )
    titles, facts = (read or definitions)(list(named), list(classes))
    return Ways(titles, facts)


def definitions(named: list[str], classes: list[tuple[str, str]]) -> tuple[dict, dict]:
    """(titles, facts) that the kernels ``named`` and the structures' ``classes`` ((variant,
    class path), the first with a title names its variant) declare."""
    facts, titles = {}, {"structure": {}, "attention": {}}
    for name in named:
        try:
            kernel = kernels.get(name)
        except Exception:  # a module that no longer imports, or fails importing: named by value
            continue
        facts[name] = kernel.facts()
        if kernel.title:
            titles["attention"][name] = kernel.title
    for variant, target in classes:
        if variant not in titles["structure"]:
            title = _class_title(target)
            if title:
                titles["structure"][variant] = title
    return titles, facts


def _class_title(target: str) -> str:
    from harness.way.capabilities import locate

    try:
        return str(getattr(locate(target), "title", "") or "")
    except Exception:  # a class that no longer imports: named by its value
        return ""


def write_ways(root: str | Path, rows: pd.DataFrame, read: Callable | None = None) -> Path:
    path = Path(root) / WAYS_FILE
    atomic_write_text(path, ways_of(rows, read).to_json())
    return path
