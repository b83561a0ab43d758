"""What a run's report needs of its ways, read from their own definitions when the run ends: each
attention kernel's ``Kernel`` entry (harness/way/kernels.py: title, scores, order, memory) and each
structure's class ``title``, written as ways.json beside env.json (harness/report/ways.py reads
it, torch-free). So a kernel is one file: a new one, built in or outside the repository, reaches
the report of every run that ran it, and nothing committed is regenerated for it.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import yaml

from harness.way import kernels
from harness.report.ways import WAYS_FILE, Ways
from harness.results import factors
from harness.files import atomic_write_text


# The built-in structures: the variant config group's files (name -> class path)
VARIANTS = Path(__file__).resolve().parents[2] / "conf" / "variant"


def ways_of(rows: pd.DataFrame) -> Ways:
    """The titles and kernel facts of every built-in structure and kernel, and of each one
    ``rows`` ran (an outside kernel by its module path; one that no longer imports is left
    out: the report names it by its value)."""
    records = rows.to_dict("records") if len(rows) else []
    builtin = [
        {"variant": p.stem, "variant_target": yaml.safe_load(p.read_text()).get("_target_")}
        for p in sorted(VARIANTS.glob("*.yaml"))
    ]
    named = dict.fromkeys(kernels.builtin())
    named.update(dict.fromkeys(f["attention"] for f in map(factors, records) if "attention" in f))
    facts, titles = {}, {"structure": {}, "attention": {}}
    for name in named:
        try:
            kernel = kernels.get(name)
        except Exception:  # a module that no longer imports, or fails importing: named by value
            continue
        facts[name] = kernel.facts()
        if kernel.title:
            titles["attention"][name] = kernel.title
    for r in [*builtin, *records]:
        target, variant = r.get("variant_target"), r.get("variant")
        if (
            isinstance(target, str)
            and isinstance(variant, str)
            and variant not in titles["structure"]
        ):
            title = _class_title(target)
            if title:
                titles["structure"][variant] = title
    return Ways(titles, facts)


def _class_title(target: str) -> str:
    from harness.way.capabilities import locate

    try:
        return str(getattr(locate(target), "title", "") or "")
    except Exception:  # a class that no longer imports: named by its value
        return ""


def write_ways(root: str | Path, rows: pd.DataFrame) -> Path:
    path = Path(root) / WAYS_FILE
    atomic_write_text(path, ways_of(rows).to_json())
    return path
