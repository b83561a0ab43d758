"""The attention kernels: one module per kernel, each defining ``KERNEL = Kernel(...)``.

A kernel is the step between the projections and the head merge: q (B, H, L, D), k/v
(B, H, S, D) and the point's masks in, out (B, H, L, D) back. ``variant.attention=<name>`` picks
one of the modules here by file name; any other name (``variant.attention=pkg.module``) is
imported as a module that defines ``KERNEL``, so an outside kernel is one file and nothing else
(docs/adding.md, "Adding an attention kernel").

What a kernel declares (masks, dtypes, devices, backward, an optional package) is applied to a
point before its module is built (harness/capabilities.py): a point it cannot do is
``unsupported`` with the kernel's reason and costs nothing. The toggles preset, the contract tests
and docs/reference.md's kernel list are derived from this registry.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from dataclasses import dataclass
from typing import Callable

from harness.capabilities import CAPABILITY_CHOICES

# By default a kernel declares every value the config allows (harness/config.py's choices).
MASKS = CAPABILITY_CHOICES["mask"]
DTYPES = CAPABILITY_CHOICES["dtype"]
DEVICES = CAPABILITY_CHOICES["device"]


@dataclass(frozen=True)
class Kernel:
    name: str  # what variant.attention says; a module path for an outside kernel
    fn: Callable  # fn(q, k, v, masks: Masks) -> out (B, H, L, D); see Masks
    doc: str  # one line for docs/reference.md and the conf comments
    masks: tuple = MASKS  # the point masks it computes as nn.MultiheadAttention does
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

    def supports(self) -> dict:
        """What it can do, as a variant's ``_supports_`` (harness/capabilities.py applies it)."""
        out = {"mask": self.masks, "dtype": self.dtypes, "device": self.devices}
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


def builtin() -> tuple[str, ...]:
    """The kernels of this package, by module name (files starting with _ are helpers)."""
    return tuple(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))


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
    path = f"{__name__}.{name}" if name in known else name
    try:
        module = importlib.import_module(path)
    except ModuleNotFoundError as exc:
        # the module itself is not there: a typo, most likely
        if exc.name and path.startswith(exc.name):
            raise ValueError(refusal) from None
        raise ValueError(f"attention={name!r}: {path} does not import ({exc})") from None
    except ImportError as exc:
        raise ValueError(f"attention={name!r}: {path} does not import ({exc})") from None
    kernel = getattr(module, "KERNEL", None)
    if not isinstance(kernel, Kernel):
        raise ValueError(f"attention={name!r}: {path} defines no KERNEL = Kernel(...)")
    return kernel


def everywhere() -> tuple[str, ...]:
    """The built-in kernels that need no optional package: the toggles preset sweeps these."""
    return tuple(n for n in builtin() if get(n).package is None)
