"""The attention kernel registry: the ``Kernel`` type every kernel module defines, and the lookup.

A kernel is the step between the projections and the head merge: q (B, H, L, D), k/v
(B, H, S, D) and the point's masks in, out (B, H, L, D) back. Each is one module defining
``KERNEL = Kernel(...)``: the built-in ones are the modules of the plug-in package ``PACKAGE``
(variants/kernels/, found by file name), an outside one any importable module
(``variant.attention=pkg.module``; docs/adding.md, "Adding an attention kernel").

Everything the harness knows about a kernel is a field of its entry: what it declares (masks,
dtypes, devices, backward, an optional package; applied to a point before its module is built,
harness/way/capabilities.py), whether it holds the (L, S) scores (the memory estimate,
harness/way/footprint.py), its place in the baseline order (harness/report/effects.py), and
how findings name it and its memory (harness/report/findings.py). A run writes the facts of the
kernels it ran into its ways.json (harness/sweep/facts.py) for the torch-free report; the
presets sweep ``kernels()`` (``everywhere``) and ``mha-bench kernels`` lists them (``main``), so
adding a kernel is adding its file: nothing committed is regenerated.

A ground-floor module: it imports no kernel and nothing of variants/ until a kernel is asked for
by name (importlib), so the harness depends on the plug-ins only through this lookup.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from dataclasses import dataclass, field
from typing import Callable

from harness.config import InvalidPoint
from harness.declarations import CAPABILITY_CHOICES, parse_declaration

PACKAGE = "variants.kernels"  # the built-in kernels: its modules, by file name

# By default a kernel declares every value the config allows (harness/config.py's choices).
MASKS = CAPABILITY_CHOICES["mask"]
DTYPES = CAPABILITY_CHOICES["dtype"]
DEVICES = CAPABILITY_CHOICES["device"]


@dataclass(frozen=True)
class Kernel:
    name: str  # what variant.attention says; a module path for an outside kernel
    fn: Callable  # fn(q, k, v, masks: Masks) -> out (B, H, L, D); see Masks
    doc: str  # one line for docs/reference.md and the conf comments
    # how findings name it ("F.scaled_dot_product_attention"); empty: "attention=<name>". The
    # report reads it from the run's ways.json (harness/sweep/facts.py writes it)
    title: str = ""
    masks: tuple = MASKS  # the point masks it computes as nn.MultiheadAttention does
    # The model features' values it computes, where fewer than the config allows: {key: values}
    # as a variant's ``_supports_`` says them (variants/kernels/flash_attn.py: no ALiBi, no
    # sink). Each feature's part of ``Masks`` is its own (harness/features/); a kernel says here
    # which it does not read.
    limits: dict = field(default_factory=dict, compare=False)
    dtypes: tuple = DTYPES
    devices: tuple = DEVICES
    backward: bool = True  # mode=fwd_bwd
    reason: str = ""  # why it declares less than everything, for the unsupported row
    package: str | None = None  # an optional package it imports (checked when the module is built)
    install: str = ""  # the install-beside-torch.sh arguments for that package
    # The row's sdpa_kernel column names this kernel when no SDPA op ran (manual and sdpa: no,
    # the column then says which SDPA backend ran, or none).
    names_itself: bool = True
    # Takes k/v with fewer heads than q (grouped-query attention: query head h uses K/V head
    # h // G). False: the variant repeats each K/V head for its group before calling it.
    gqa: bool = False
    # Holds the (B, H, L, S) scores and probabilities: the memory estimate counts them, and the
    # memory finding sets it against a kernel that does not.
    scores: bool = False
    # Its place in the baseline order: of two kernels, effects take the lower as the baseline
    # (the simpler kernel, so that a ratio reads as what the more elaborate one buys); a tie goes
    # by name. A kernel of no registry (an outside one) comes after these.
    order: int = 100
    # What the memory finding may say of its memory, after its figures ("no (L, S) scores in
    # its fused backends"); a kernel with scores=True gets how much its scores grow instead.
    memory: str = ""
    # Swept by ``variant.attention=kernels()`` (the toggles and main-job presets): False for a
    # kernel of one mask (per_document), which would add a row per point that mostly says
    # ``unsupported`` or repeats another kernel's work.
    swept: bool = True

    def __post_init__(self):
        # checked as a variant's _supports_ is, when the kernel's module is imported: a key no
        # point has, or a value its key cannot take, is one line naming it (InvalidPoint), not
        # a crash at the first point it would refuse
        where = f"attention={self.name}: Kernel.limits"
        if "reason" in self.limits:
            raise InvalidPoint(f"{where}.reason: a kernel says why in Kernel.reason")
        object.__setattr__(self, "limits", parse_declaration(self.limits, where, "_supports_"))

    def supports(self) -> dict:
        """What it can do, as a variant's ``_supports_`` (harness/way/capabilities.py applies
        it)."""
        out = {"mask": self.masks, "dtype": self.dtypes, "device": self.devices, **self.limits}
        if not self.backward:
            out["mode"] = ("fwd",)
        return out

    def unavailable(self) -> str | None:
        """Why it cannot run here (its package does not import, with how to install it), or None."""
        if self.package is None:
            return None
        try:
            importlib.import_module(self.package)
        except Exception as exc:  # ImportError, or a build that does not match this torch
            return (
                f"attention={self.name}: {self.package.split('.')[0]} does not import here "
                f"({type(exc).__name__}: {exc}); install it beside torch: "
                f"bash scripts/install-beside-torch.sh {self.install}"
            )
        return None

    def facts(self) -> dict:
        """What the torch-free report needs of it (a run's ways.json, harness/sweep/facts.py)."""
        return {
            "title": self.title,
            "scores": self.scores,
            "order": self.order,
            "memory": self.memory,
        }


def builtin() -> tuple[str, ...]:
    """The kernels of ``PACKAGE``, by module name (files starting with _ are helpers)."""
    package = importlib.import_module(PACKAGE)
    return tuple(
        m.name for m in pkgutil.iter_modules(package.__path__) if not m.name.startswith("_")
    )


@functools.lru_cache(maxsize=None)
def get(name: str) -> Kernel:
    """The kernel ``variant.attention`` names; ValueError naming the value when there is none."""
    known = builtin()
    refusal = (
        f"attention={name!r} is not one of {'|'.join(known)} "
        "(nor an importable module that defines KERNEL)"
    )
    if not isinstance(name, str) or not name:
        raise ValueError(refusal)
    path = f"{PACKAGE}.{name}" if name in known else name
    try:
        module = importlib.import_module(path)
    except ModuleNotFoundError as exc:
        # the module itself is not there: a typo, most likely
        if exc.name and path.startswith(exc.name):
            raise ValueError(refusal) from None
        raise ValueError(f"attention={name!r}: {path} does not import ({exc})") from None
    except ImportError as exc:
        raise ValueError(f"attention={name!r}: {path} does not import ({exc})") from None
    except (Exception, SystemExit) as exc:  # its own code failed as it imported (issue 74: the
        # worker died of it, and `mha-bench kernels MODULE` printed its traceback)
        raise ValueError(
            f"attention={name!r}: importing {path} raised {type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''} (fix the module)"
        ) from None
    kernel = getattr(module, "KERNEL", None)
    if not isinstance(kernel, Kernel):
        raise ValueError(f"attention={name!r}: {path} defines no KERNEL = Kernel(...)")
    return kernel


def everywhere() -> tuple[str, ...]:
    """The built-in kernels that need no optional package, in the baseline order: the toggles
    and main-job presets sweep these (not those that say ``swept=False``)."""
    return tuple(n for n in in_order(builtin()) if get(n).package is None and get(n).swept)


def in_order(names) -> list[str]:
    """Kernel names in the baseline order (``Kernel.order``, then the name)."""
    return sorted(names, key=lambda n: (get(n).order, n))


def table(names) -> list[str]:
    """A markdown row per kernel: what it is and what it declares (``mha-bench kernels``)."""
    out = [
        "| kernel | what it is | masks | dtypes | devices | backward | needs | order |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name in names:
        k = get(name)
        needs = f"`{k.package.split('.')[0]}`" if k.package else ""
        cells = (
            f"`{name}`",
            k.doc,
            ", ".join(k.masks),
            ", ".join(k.dtypes),
            ", ".join(k.devices),
            "yes" if k.backward else "no",
            needs,
            str(k.order),
        )
        # one line per row: a newline in a doc would break the table
        out.append("| " + " | ".join(" ".join(str(c).split()).replace("|", "\\|") for c in cells)
                   + " |")  # fmt: skip
    return out


def main(argv: list[str]) -> int:
    """``mha-bench kernels [MODULE ...]``: the built-in kernels in their baseline order (and the
    outside kernel modules named), with what each declares and, where its package does not
    import here, how to install it."""
    import sys

    if any(a in ("-h", "--help") for a in argv):
        print(
            "usage: mha-bench kernels [MODULE ...]\n"
            "the attention kernels of variants/kernels/ in their baseline order (and the outside "
            "kernel modules named): what each declares; variant.attention=kernels() sweeps those "
            "that need no optional package"
        )
        return 0
    try:
        names = in_order([*builtin(), *argv])
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("\n".join(table(names)))
    missing = [get(n).unavailable() for n in names]
    for line in filter(None, missing):
        print(f"note: {line}")
    print(f"kernels(): {','.join(everywhere())}")
    return 0
