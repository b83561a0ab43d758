"""Writing the run's files so that nothing is half-written: ``atomic_write_text`` (a temporary
file, then a rename), ``check_writable`` (found out before the first point, not after the
last), and the two failures they raise: ``WriteError`` (one line naming the file and why) and
``Unwritable`` (a row that could not be written stops the sweep). Ground: imports nothing of
the harness.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


class WriteError(OSError):
    """A file of the results could not be written; the message names it and why, in one line."""


class Unwritable(BaseException):
    """A point's row could not be written (``error``: its WriteError): the sweep stops there,
    since every later row would be lost too. A BaseException, as KeyboardInterrupt is: Hydra
    keeps a job's Exception and runs the next jobs, each failing the same way."""

    def __init__(self, error: WriteError):
        super().__init__(error.strerror)
        self.error = error


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


UMASK = _umask()  # read once: os.umask can only be read by setting it


def atomic_write_text(path: Path, text: str) -> None:
    """Write to a temporary file in the same dir, then rename: a reader never sees half a file.
    The file gets the usual mode (0666 less the umask; mkstemp alone would leave it 0600)."""
    path = Path(path)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.fchmod(fd, 0o666 & ~UMASK)
        with os.fdopen(fd, "w", newline="") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as e:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        raise WriteError(e.errno, f"cannot write {path}: {e.strerror or e}") from e
    except BaseException:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        raise


def check_writable(path: str | os.PathLike) -> None:
    """Create ``path`` (a dir) if needed and prove a file can be written there: a sweep finds
    out before its first point, not after its last (``WriteError`` naming it otherwise)."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path, prefix=".write-test.")
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        raise WriteError(e.errno, f"cannot write to {path}: {e.strerror or e}") from e
