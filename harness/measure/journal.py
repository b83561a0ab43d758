"""The rounds' journal: every repetition is on disk the moment it ends.

Why: a timed point's row is complete only when its rounds end, which in a sweep is after its
last job. A sweep killed in its rounds (SIGKILL, a cluster's time limit, the OOM killer) would
lose every repetition that had finished. So each one is appended to a journal as one JSON line
and flushed at once (to the kernel: it survives the death of the process): a kill loses at most
the repetition in flight, and ``resume=true`` reads the lines back and runs only the rounds that
are missing.

One line per repetition, keyed by whose it is (a point's job, or a reference built for pairing):

    {"key": "3:9f2c...", "run": "1732345678123-4242", "round": 2, "at": 1732345690.5,
     "ms": 0.412, "growth": 0, "recompiles": 0, "eager_ms": null, "contended": false}

(``eager_ms``: on CUDA with a graph, the eager call's median beside the replay's ``ms``;
``contended``: a busy machine spoiled the repetition, harness/measure/contention.py; ``cpu_ms``:
on the CPU, the calls' median CPU time on the timed thread beside the wall time ``ms``.)

``run`` names the sweep invocation that timed it: a speedup pairs a way's repetition with the
reference's of the same round *and run*, so that resumed rounds are never paired across the gap
between two runs. A point that starts afresh writes ``{"key": ..., "reset": true}``: its earlier
lines no longer count. A line cut short by a kill is skipped when read.
"""

from __future__ import annotations

import json
import math
import zlib
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger("harness")
JOURNAL_FILE = "rounds.jsonl"


@dataclass(frozen=True)
class Sample:
    """One repetition of a point: its round and the median of its calls."""

    round: int
    at: float  # wall-clock seconds (time.time()) when the repetition started
    ms: float  # median of the repetition's calls
    run: str  # the sweep invocation that timed it (pairs only within one run)
    growth: int | None = None  # bytes the process gained over the repetition (None: not measured)
    recompiles: int = 0  # graphs compiled during the repetition
    # CUDA with a graph: the eager call's median in the same repetition (``ms`` is the replay's)
    eager_ms: float | None = None
    # Contention spoiled it (harness/measure/contention.py): re-timed in a later round, and left
    # out of every interval, ranking and effect while the point has enough clean rounds.
    contended: bool = False
    # CUDA with a graph and the L2 flush: the replay's median without the flush, the L2 as the
    # previous call left it, as the eager call runs (what ``launch_bound`` compares it with)
    warm_ms: float | None = None
    # The CPU: the median of its calls' CPU time on the timed thread (``Session.timed_by`` "cpu":
    # the figure that decides with one thread; ``ms`` stays the wall time)
    cpu_ms: float | None = None


def new_run_id() -> str:
    """A name for this invocation's rounds, distinct from any earlier run's."""
    return f"{time.time_ns() // 1_000_000}-{os.getpid()}"


def _sealed(record: dict) -> bytes:
    """A journal line: the record with the CRC-32 of its own text (``_opened`` checks it), so
    that a value edited or damaged on disk is read past, not timed (resume took a sample of
    1e6 ms as it stood: 0.22 ms [0.0074, 6.8] where the point's 0.048 was)."""
    text = json.dumps(record, separators=(",", ":"))
    return json.dumps({**record, "crc": zlib.crc32(text.encode())}, separators=(",", ":")).encode()


def _opened(line: str) -> dict:
    """A line's record; ``ValueError`` when it has no seal or its seal does not match its text,
    or a sample's times are not positive and finite. (A line whose ``crc`` was deleted read as
    valid, issue 74; a journal from before the seal is timed again, nothing lost.)"""
    record = json.loads(line)
    crc = record.pop("crc", None)
    if crc != zlib.crc32(json.dumps(record, separators=(",", ":")).encode()):
        raise ValueError("the line has no seal" if crc is None else "its seal does not match")
    for name in ("ms", "eager_ms", "warm_ms", "cpu_ms"):
        value = record.get(name)
        if value is not None and not (isinstance(value, (int, float)) and 0 < value < math.inf):
            raise ValueError(f"{name}={value!r}")
    return record


class Journal:
    """Append-only, one JSON line per event. A write that fails (a full disk) is said once and
    the rounds go on: the journal only matters if the sweep is killed."""

    def __init__(self, path: str | os.PathLike, lost: str = "those repetitions are timed again"):
        self.path = Path(path)
        self.lost = lost  # what becomes of the lines read past, said with their count
        self._file = None
        self._failed = False
        self._read = 0  # bytes of the file parsed into _samples so far
        self._samples: dict[str, list[Sample]] = {}  # since each key's last reset
        self.damaged = self._said = 0  # lines read past: cut short, edited, not ours (``load``)

    def _write(self, record: dict) -> None:
        if self._failed:
            return
        try:
            if self._file is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._file = open(self.path, "ab")
                if self._file.tell():
                    with open(self.path, "rb") as f:
                        f.seek(-1, os.SEEK_END)
                        if f.read(1) != b"\n":
                            self._file.write(b"\n")  # a line a kill cut short must not swallow ours
            self._file.write(_sealed(record) + b"\n")
            self._file.flush()
        except OSError as e:
            self._failed = True
            log.warning(
                f"warning: cannot write the rounds' journal {self.path} ({e.strerror or e}); "
                "timing goes on, but a kill would lose its finished rounds"
            )

    def append(self, key: str, sample: Sample) -> None:
        self._write({"key": key, **asdict(sample)})

    def reset(self, key: str) -> None:
        """``key`` starts afresh: lines written for it before this one no longer count."""
        self._write({"key": key, "reset": True})

    def load(self, key: str) -> list[Sample]:
        """The samples recorded for ``key`` since its last reset, in the order written. The file
        is parsed once, then only what was added since (a sweep of many points reads it once)."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self._read)
                new = f.read()
        except OSError:
            new = b""
        end = new.rfind(b"\n") + 1  # whole lines only: a line being written is read next time
        self._read += end
        for line in new[:end].decode("utf-8", errors="replace").splitlines():
            try:
                record = _opened(line)
                if record.get("reset"):
                    self._samples[record["key"]] = []
                    continue
                self._samples.setdefault(record["key"], []).append(
                    Sample(
                        int(record["round"]),
                        float(record["at"]),
                        float(record["ms"]),
                        str(record["run"]),
                        record.get("growth"),
                        int(record.get("recompiles", 0)),
                        _float(record.get("eager_ms")),
                        bool(record.get("contended", False)),
                        _float(record.get("warm_ms")),
                        _float(record.get("cpu_ms")),
                    )
                )
            except (ValueError, KeyError, TypeError, AttributeError):
                if line.strip():  # a line cut short by a kill, edited, or not ours
                    self.damaged += 1
        if self.damaged > self._said:
            log.warning(
                f"warning: {self.damaged - self._said} line(s) of the rounds' journal {self.path} "
                f"read past (cut short by a kill, edited or damaged): {self.lost}"
            )
            self._said = self.damaged
        return list(self._samples.get(key, []))

    def keys(self) -> list[str]:
        """Every key with samples since its last reset (the file read as ``load`` reads it)."""
        self.load("")
        return [k for k, v in self._samples.items() if v]

    def close(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass
            self._file = None


def _float(x) -> float | None:
    return None if x is None else float(x)


_OPEN: dict[Path, Journal] = {}


def journal_at(path: str | os.PathLike) -> Journal:
    """The process's one ``Journal`` for ``path`` (points of one sweep share the sweep's)."""
    path = Path(path).resolve()
    if path not in _OPEN:
        _OPEN[path] = Journal(path)
    return _OPEN[path]
