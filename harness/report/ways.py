"""How a run's report names and orders its ways: ``ways.json`` beside env.json.

What the report says of a structure or an attention kernel comes from its own definition (a
variant class's ``title``; a kernel's ``Kernel`` entry in its one file, harness/way/kernels.py): the
run reads them from the registries when it ends (harness/sweep/facts.py) and writes them into its
directory, so that the torch-free report (and ``mha-bench report`` on another machine) reads
them from there. Adding a kernel, built-in or outside the repository, changes nothing committed
elsewhere: its title, its place in the baseline order and what findings say of its memory
reach the report of every run that ran it.

A run without the file (older runs) names its ways by their values ("attention=sdpa").
Torch-free.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from harness import features

WAYS_FILE = "ways.json"

# How findings name the config's own values (no registry defines these), and the oracle.
NAMES = {
    ("structure", "reference"): "nn.MultiheadAttention",
    ("merge", "view"): "the view head merge",
    ("merge", "reshape"): "the reshape head merge",
    ("compile", "off"): "eager",
    ("compile", "default"): "torch.compile",
    ("kv_cache", "static"): "a static KV cache (written in place)",
    ("kv_cache", "concat"): "a concatenated KV cache (torch.cat per step)",
    ("mask", "causal"): "full causal attention",
}
# A kernel no file describes (an older run) comes after every described one, by name.
UNKNOWN_ORDER = 1000


# A kernel's facts in ways.json (harness/way/kernels.py, Kernel.facts) and their types: a file
# missing one is damaged, said, and read past (a kernel without its order ended `report` in
# KeyError: 'order').
KERNEL_FACTS = {"title": str, "scores": bool, "order": int, "memory": str}
KINDS = {str: "text", bool: "true or false", int: "an integer"}


@dataclass(frozen=True)
class Ways:
    # factor ("structure", "attention") -> value -> how findings name it
    titles: dict = field(default_factory=dict)
    # attention value -> the kernel's facts (harness/way/kernels.py, Kernel.facts: title, scores,
    # order, memory)
    kernels: dict = field(default_factory=dict)

    def name(self, factor: str, value: str) -> str:
        if factor == "num_kv_heads":
            return f"{value} K/V head" + ("s" if value != "1" else "")
        if factor == "mask" and value.startswith("sliding:"):
            return f"a sliding window of {value.partition(':')[2]} keys"
        said = features.title(factor, value)  # a value a model feature makes (harness/features/)
        if said is not None:
            return said
        title = self.titles.get(factor, {}).get(value)
        return title or NAMES.get((factor, value), f"{factor}={value}")

    def kernel(self, value: str) -> dict | None:
        """The facts of the kernel ``attention=value`` names, or None where none is known."""
        return self.kernels.get(str(value))

    def kernel_order(self, value: str) -> int:
        facts = self.kernel(value)
        return int(facts["order"]) if facts else UNKNOWN_ORDER

    def to_json(self) -> str:
        return (
            json.dumps({"titles": self.titles, "kernels": self.kernels}, indent=2, sort_keys=True)
            + "\n"
        )

    @classmethod
    def from_json(cls, text: str) -> "Ways":
        """ValueError naming what is wrong where the text is not a ways file."""
        try:
            data = json.loads(text)
        except ValueError as e:
            raise ValueError(f"not JSON ({e})") from None
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        titles, kernels = data.get("titles", {}), data.get("kernels", {})
        if not all(isinstance(t, dict) for t in (titles, kernels)) or not all(
            isinstance(v, dict) for v in (*titles.values(), *kernels.values())
        ):
            raise ValueError("titles and kernels must be objects of objects")
        for name, facts in kernels.items():  # what Kernel.facts writes, each as the report reads it
            for key, kind in KERNEL_FACTS.items():
                value = facts.get(key)
                if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                    raise ValueError(
                        f"kernel {name!r}: {key} must be {KINDS[kind]}"
                        + (" (it has none)" if key not in facts else f", not {value!r}")
                    )
        return cls(titles, kernels)


def way_name(label: str) -> str:
    """A way as the findings name it: nn.MultiheadAttention for the reference's label
    ("reference compile=default": "nn.MultiheadAttention compile=default"), else the label."""
    head, _, rest = str(label).partition(" ")
    if head == "reference":
        return NAMES[("structure", "reference")] + (f" {rest}" if rest else "")
    return str(label)


def load(root: Path | None, problems: list[str] | None = None) -> Ways:
    """``root``'s ways.json; without one (or with one that is damaged, said in ``problems``),
    ways named by their values."""
    path = None if root is None else Path(root) / WAYS_FILE
    if path is None or not path.is_file():
        return Ways()
    try:
        return Ways.from_json(path.read_text(encoding="utf-8", errors="replace"))
    except (OSError, ValueError) as e:
        if problems is not None:
            problems.append(f"{path}: {e}; the ways are named by their values")
        return Ways()
