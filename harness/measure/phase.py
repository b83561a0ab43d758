"""Which stage of a point its calls are in: ``rounds`` while a timing repetition runs, else
``setup`` (build, check, warm-up, probe, profile, the re-check). The harness sets it; a module
may read it (``current()``), as the test gallery's planted faults do to fail in their timing
rounds whatever the machine's speed (tests/faulty/faults.py): counting calls made a loaded
machine's rounds end before the fault fired."""

from __future__ import annotations

import contextlib

_NOW = ["setup"]


def current() -> str:
    return _NOW[-1]


@contextlib.contextmanager
def phase(name: str):
    _NOW.append(name)
    try:
        yield
    finally:
        _NOW.pop()
