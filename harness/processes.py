"""Processes a variant leaves running: found by parent (a point's children, named in its row) and
by the mark every process of one worker inherits (``MARK``, in its environment), so that one
that called ``setsid`` and left the worker's process group is still ended with the worker.

Linux's /proc; elsewhere nothing is found (the worker's group is still killed).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

MARK = "MHA_BENCH_WORKER"  # environment variable: the worker's token, inherited by its children
PROC = Path("/proc")
# processes torch or Python start in a worker on their own (inductor's compile pool,
# multiprocessing's helpers): not the variant's
OWN = ("torch/_inductor", "torch._inductor", "multiprocessing.resource_tracker",
       "multiprocessing.forkserver")  # fmt: skip


def _stat(pid: str) -> tuple[str, int] | None:
    """(state, parent pid) of ``pid``, None where it is gone."""
    try:
        fields = (PROC / pid / "stat").read_text().rsplit(")", 1)[1].split()
        return fields[0], int(fields[1])
    except (OSError, IndexError, ValueError):
        return None


def command(pid: int, short: bool = True) -> str:
    """``pid``'s command line, cut to 60 characters where ``short`` ("?" where it is gone)."""
    try:
        raw = (PROC / str(pid) / "cmdline").read_bytes()
    except OSError:
        return "?"
    line = raw.replace(b"\0", b" ").decode(errors="replace").strip()
    return line if not short or len(line) <= 60 else line[:57] + "..."


def _pids() -> list[str]:
    try:
        return [e.name for e in os.scandir(PROC) if e.name.isdigit()]
    except OSError:
        return []


def _own(pid: int) -> bool:
    """Whether ``pid`` or one of its ancestors is torch's or Python's own: inductor's compile
    pool starts its workers by multiprocessing's spawn, whose command line names no torch."""
    for _ in range(8):  # a pool's worker is two or three levels below it
        if any(own in command(pid, short=False) for own in OWN):
            return True
        stat = _stat(str(pid))
        if stat is None or stat[1] <= 1:
            return False
        pid = stat[1]
    return False


def children(pid: int | None = None) -> set[int]:
    """The live processes whose parent is ``pid`` (this one)."""
    pid = os.getpid() if pid is None else pid
    found = set()
    for p in _pids():
        stat = _stat(p)
        if stat is not None and stat[1] == pid and stat[0] != "Z":
            found.add(int(p))
    return found


def started() -> set[int]:
    """The live processes this one started, directly or not, less torch's and Python's own: by
    its mark where it has one (a sweep's worker: a daemon that forked twice or called setsid is
    found too), else its children."""
    token = os.environ.get(MARK)
    return {p for p in (marked(token) if token else children()) if not _own(p)}


def marked(token: str) -> set[int]:
    """The live processes carrying ``MARK=token`` in their environment, this one excepted."""
    needle = f"{MARK}={token}".encode()
    found = set()
    for p in _pids():
        if int(p) == os.getpid():
            continue
        try:
            environ = (PROC / p / "environ").read_bytes()
        except OSError:
            continue
        stat = _stat(p)
        if needle in environ.split(b"\0") and stat is not None and stat[0] != "Z":
            found.add(int(p))
    return found


def end(pids: set[int]) -> list[str]:
    """SIGKILL each of ``pids``; "pid (command)" for each that was alive."""
    said = []
    for pid in sorted(pids):
        name = command(pid)
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            continue
        said.append(f"{pid} ({name})")
    return said
