"""The attention kernels: one module per kernel, each defining ``KERNEL = Kernel(...)``.

A kernel is the step between the projections and the head merge: q (B, H, L, D), k/v
(B, H, S, D) and the point's masks in, out (B, H, L, D) back. ``variant.attention=<name>`` picks
one of the modules here by file name; any other name (``variant.attention=pkg.module``) is
imported as a module that defines ``KERNEL``, so an outside kernel is one file and nothing else
(docs/adding.md, "Adding an attention kernel").

The ``Kernel`` type and the registry (``get``, ``builtin``, ``everywhere``) are those of
harness/way/kernels.py, re-exported here so that a kernel writes ``from variants.kernels import
Kernel``; what a kernel declares, and what the harness derives from it, is described there.
"""

from harness.way.kernels import DEVICES, DTYPES, MASKS, PACKAGE, Kernel, builtin, everywhere, get

__all__ = ["DEVICES", "DTYPES", "MASKS", "PACKAGE", "Kernel", "builtin", "everywhere", "get"]
