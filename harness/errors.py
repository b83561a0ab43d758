"""What a failure inside a point means: its status (oom, unsupported, error) and one-line message.

Shared by the point's own stages and by the rounds that time it later, so a failure reads the
same wherever it happens.
"""

from __future__ import annotations

import torch


class Unsupported(Exception):
    """This machine or backend cannot run the point as asked; recorded as ``unsupported``."""


class Terminated(KeyboardInterrupt):
    """SIGTERM (``timeout``, ``kill``, a cluster's time limit): the sweep stops as on Ctrl-C,
    keeping what finished, and exits 143 instead of 130."""


def classify(exc: BaseException) -> str:
    msg = str(exc)
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)) or any(
        s in msg.lower() for s in ("out of memory", "can't allocate memory")
    ):
        return "oom"
    if (
        isinstance(exc, (Unsupported, NotImplementedError))
        or "not implemented for" in msg
        or any(s in msg for s in ("No available kernel", "No viable backend"))
    ):
        return "unsupported"
    return "error"


def one_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return " ".join(text.split())[:500]
