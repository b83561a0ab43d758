"""Points run in a worker process, so that a crash, an exit or a hang costs its own row only.

Why: a variant is arbitrary code. An exception (``SystemExit`` included) is caught where it
happens, but ``os._exit``, a native abort, the kernel's OOM killer or a forward that never
returns would end or freeze the whole sweep. So every job process (with Hydra's basic launcher:
the sweep's one process) keeps one worker process, started at its first point and reused (torch
is imported once; the yardstick cache, the measured peaks and the CUDA context live there), and
replaced after a death.

This module is the job process's side (``Worker``); the worker process's loop is
harness/sweep/serve.py.

Protocol, pickled tuples over a pipe:

    job -> worker   ("prepare", id, point, root, trace_root, job_num, journal, prior)
                                      build, check, warm up, probe, profile
                    ("rounds",)       time every point waiting in its pool
                    ("stop",)         Ctrl-C: end the rounds now
    worker -> job   ("begin", id, row)
                                      the point's identity columns, before anything runs
                    ("checked", id, row)
                                      checked, to be timed: its verdict, to be written now
                    ("prepared", id, row, rep_s)
                                      rep_s None: the row is final (not timed, or failed)
                    ("invalid", id, message)
                                      a bad value (build_variant's InvalidPoint)
                    ("visit", id, round)
                                      a repetition of point id starts (id None: a pairing nn.MHA)
                    ("row", id, row)  a timed point's completed row
                    ("log", level, text)
                                      the worker's log lines (peak measurement)
                    ("say", text)     the rounds' progress
                    ("pause", id), ("resume", id)
                                      the matmul peak is being measured: not the point's time
                    ("idle",)         the rounds are over
                    ("restart", text) a sticky CUDA error (illegal address, device-side
                                      assert), or a point changed torch's functions
                                      (harness/fingerprint.py): the point's row was sent;
                                      the worker reads nothing more and the job replaces
                                      it, preparing the points that waited in it again

The job process writes every row itself. Whose call the worker died or hung in is the last
"begin" or "visit": that point gets a ``crashed`` or ``timeout`` row. Points that were waiting
in the dead worker for their rounds are prepared again in a new one before the rounds (their
check runs again; each row is still written once).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from multiprocessing.connection import Connection
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from harness import processes  # torch-free
from harness.outcome import Verdict  # torch-free
from harness.schema import Environment, Identity, Record  # torch-free

if TYPE_CHECKING:  # importing harness.config imports torch: the job process starts its worker first
    from harness.config import Point

log = logging.getLogger("harness")
RETRIES = (
    2  # a point whose worker died under another point's call is prepared again at most this often
)
VISIT_NAP_S = (
    0.25  # during the rounds the job process reads the worker's queued messages at most this often
)
STOP_GRACE_S = 60.0  # Ctrl-C in the rounds: how long the worker may take to hand back what it has
ASK_S = 120.0  # Worker.ask: how long a question may wait for the answer (a start on a busy machine)


def crash_message(exitcode: int | None) -> str:
    """What a dead worker's exit code says, in words a user can act on."""
    if exitcode is None:
        return "the worker process vanished"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        why = {
            "SIGKILL": "killed by SIGKILL, likely out of memory (the kernel's OOM killer)",
            "SIGSEGV": "crashed with SIGSEGV (segmentation fault in native code)",
            "SIGABRT": "crashed with SIGABRT (abort() in native code)",
            "SIGBUS": "crashed with SIGBUS (bad memory access in native code)",
        }
        return why.get(name, f"killed by {name}")
    return f"the worker process exited with code {exitcode} (os._exit or exit() in native code)"


# What stops a run: Ctrl-C, SIGTERM (timeout, a cluster's limit), SIGHUP (a closed terminal).
STOPS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}


@contextlib.contextmanager
def _signals_deferred():
    """Ctrl-C, SIGTERM and SIGHUP wait until the block ends. Python raises their exceptions
    between any two bytecodes, also between the header and the body of a message: the rest of
    that message would then be read as the next one, and the rows the worker hands back on
    stopping would be lost. Held, they act right after the message is read (or sent) and
    handled."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, STOPS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


@dataclass(eq=False)
class _Job:
    id: int
    point: Point
    request: tuple
    on_row: Callable[[Record], None]  # the final record of a point that waited for its rounds
    on_checked: Callable[[Record], None] | None = None  # its record once checked, before any rounds
    row: Record | None = None  # the latest record the worker sent ("begin", then "prepared")
    spent: float = 0.0  # seconds charged to this point so far (point_timeout)
    stage: str = "set-up (build, check, warm-up, probe, profile)"
    stale: bool = False  # its session died with a worker: prepare it again before the rounds
    retries: int = 0


class _Died(Exception):
    """The worker died or hung; ``job`` is the point whose call it was in (None: unknown)."""

    def __init__(self, job: _Job | None, status: str, message: str):
        super().__init__(message)
        self.job, self.status, self.message = job, status, message


class Worker:
    """The job process's side: sends points, charges time, writes nothing (``on_row`` does)."""

    def __init__(self) -> None:
        self.proc = None
        self.conn = None
        self.token = ""
        self.busy = False  # the worker's rounds found the machine busy (timing.when_busy=stop)
        self.waiting: dict[int, _Job] = {}  # prepared points waiting in the worker for their rounds
        self.next_id = 0
        self.say: Callable[[str], None] = log.info

    # -- the process --------------------------------------------------------------------------
    def _start(self) -> None:
        # A fresh interpreter (not fork: CUDA and OpenMP thread pools do not survive one; not
        # multiprocessing's spawn: it re-runs the parent's __main__, whatever script that is),
        # in a session of its own so that Ctrl-C reaches only the job process, which asks it to
        # stop. It gets this process's sys.path first, so it imports what this process would.
        ours, theirs = socket.socketpair()
        self.token = uuid.uuid4().hex  # every process it starts inherits it (processes.MARK)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "harness.sweep.serve", str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            start_new_session=True,
            env={**os.environ, processes.MARK: self.token},
        )
        theirs.close()
        self.conn = Connection(ours.detach())
        self.conn.send(("init", list(sys.path)))

    def start(self) -> None:
        """Start the worker now, so that it imports torch while this process does too."""
        if not self._alive():
            self._start()

    def ask(self, *request):
        """What the worker answers to ``request`` ("env": env.json's facts; "ways": what kernels
        and structures declare): read where torch and the variants are imported already, so the
        sweep's own process imports no torch (2-3 s of CPU a sweep). None: the worker died, or
        had not answered within ``ASK_S`` (its start imports torch: seconds on a busy machine)."""
        self.start()
        try:
            self.conn.send(request)
            return self._wait(lambda msg: msg[0] == request[0], within=ASK_S)[1]
        except (_Died, OSError, TimeoutError):  # the caller reads them itself
            return None

    def _alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """End the worker now, with every process it started (its session's group: a process
        a variant started and that ignores SIGINT and SIGTERM outlived the sweep); points
        waiting in it need preparing again."""
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # its group: start_new_session
            except (ProcessLookupError, PermissionError):
                pass  # none left
            self.proc.wait()
            # and those that left its group (setsid) but carry its mark
            ended = processes.end(processes.marked(self.token))
            if ended:
                self.say(
                    f"ended {len(ended)} process(es) a variant started outside the worker's "
                    f"process group (setsid): {', '.join(ended)}"
                )
        if self.conn is not None:
            self.conn.close()
        self.proc = self.conn = None
        for job in self.waiting.values():
            job.stale = True

    def close(self) -> None:
        """At exit: end the worker now. Everything it had is handed back by then (the job process
        wrote every row, and the journal is flushed at each repetition), so waiting for it to
        end on its own would only wait for its interpreter's teardown: about a second with
        torch loaded, at the end of every run."""
        self.kill()

    # -- messages -----------------------------------------------------------------------------
    def _wait(
        self, done: Callable[[tuple], bool], expect: _Job | None = None, within: float | None = None
    ) -> tuple:
        """Handle the worker's messages until one satisfies ``done`` and return it. A death or a
        hang past the running point's ``point_timeout`` raises ``_Died`` naming that point.
        The clock of a point runs from its "begin" or "visit" to the next message (a worker's
        start-up is nobody's); ``expect`` is the point being prepared. ``within``: seconds after
        which a wait for no point gives up (TimeoutError)."""
        jobs = {j.id: j for j in self.waiting.values()}
        if expect is not None:
            jobs[expect.id] = expect
        current: _Job | None = None
        since = time.monotonic()
        paused = False  # the worker is measuring the sweep's matmul peak: not the point's time
        given_up = None if within is None else time.monotonic() + within
        while True:
            limit = None
            if current is not None and current.point.point_timeout is not None and not paused:
                limit = current.point.point_timeout - current.spent - (time.monotonic() - since)
            ready = self.conn.poll(1.0 if limit is None else max(0.0, min(limit, 1.0)))
            if not ready:
                if limit is not None and limit <= 0:
                    raise self._hung(current)
                if not self._alive():
                    raise self._dead(current)
                if given_up is not None and time.monotonic() > given_up:
                    raise TimeoutError
                continue
            with (
                _signals_deferred()
            ):  # a message is read whole and handled before a Ctrl-C or SIGTERM acts
                try:
                    msg = self.conn.recv()
                except (EOFError, OSError):
                    raise self._dead(current) from None
                now = time.monotonic()
                kind = msg[0]
                if (
                    kind in ("begin", "visit", "prepared", "invalid", "row", "idle", "pause")
                    and current is not None
                    and not paused
                ):
                    # the running call ends where the next message starts
                    current.spent += now - since
                since = now
                paused = kind == "pause" or (paused and kind != "resume")
                if kind == "begin":
                    current = jobs.get(msg[1])
                    if current is not None:
                        current.row = msg[2]
                elif kind == "visit":
                    current = jobs.get(msg[1])
                    if current is not None:
                        current.stage = f"timing round {msg[2] + 1}"
                elif kind == "checked":
                    job = jobs.get(msg[1])
                    if job is not None and job.on_checked is not None:
                        job.on_checked(msg[2])
                elif kind == "row":
                    job = self.waiting.pop(msg[1], None)
                    current = None
                    if job is not None:
                        job.on_row(msg[2])
                elif kind == "restart":  # a sticky CUDA error, or torch changed: row handed over
                    self.kill()  # the points waiting in it are prepared again in a fresh one
                    log.warning(
                        f"{msg[1]}: the worker was restarted; "
                        f"{len(self.waiting)} points that waited in it are prepared again"
                    )
                    raise _Died(None, "restart", msg[1])
                elif kind == "log":
                    log.log(msg[1], msg[2])
                elif kind == "say":
                    self.say(msg[1])
                elif kind == "busy":  # timing.when_busy=stop: ended once this message is done
                    self.busy = True
                if kind in ("prepared", "invalid", "row", "idle"):
                    current = None
                if done(msg):
                    return msg
            # Let the visits queue up rather than wake at each: this process running while the
            # worker's timed calls start would steal a core from them (on a machine with few
            # cores). Nap only once the queue is read out: a nap after every visit read at most 4
            # a second, the socket filled, and the worker stalled in send() between repetitions.
            if kind == "visit" and not self.conn.poll(0):
                time.sleep(VISIT_NAP_S if limit is None else max(0.0, min(VISIT_NAP_S, limit)))

    def _dead(self, job: _Job | None) -> _Died:
        try:
            code = self.proc.wait(5)
        except subprocess.TimeoutExpired:  # its end of the pipe closed, yet it runs: end it
            code = None
        self.kill()
        return _Died(job, "crashed", crash_message(code))

    def _hung(self, job: _Job) -> _Died:
        self.kill()
        return _Died(
            job,
            "timeout",
            f"no result after point_timeout={job.point.point_timeout:g} s "
            f"(in its {job.stage}); the worker was killed",
        )

    def _failed_row(self, died: _Died) -> Record:
        job = died.job
        where = f" in its {job.stage}" if died.status == "crashed" else ""
        # a copy of the latest record the worker sent (none: it died before the point began)
        record = dataclasses.replace(job.row or Record(Identity(), Environment()))
        return record.settle(Verdict(died.status, f"{died.message}{where}"))

    def _charge(self, died: _Died, submitting: _Job | None) -> Record | None:
        """Give the point a death was charged to its row; the submitted point's row is returned."""
        if died.job is None:
            return None
        self.waiting.pop(died.job.id, None)
        row = self._failed_row(died)
        if died.job is submitting:
            return row
        died.job.on_row(row)
        return None

    # -- the job's side ------------------------------------------------------------------------
    def submit(
        self,
        point: Point,
        root: Path | None,
        trace_root: Path | None,
        job_num: int | None,
        on_row: Callable[[Record], None],
        journal: tuple[str, str] | None = None,
        prior: dict | None = None,
        on_checked: Callable[[Record], None] | None = None,
    ) -> tuple[dict, float | None]:
        """Prepare one point in the worker. Returns its row and ``rep_s``: None when the row is
        final (check_only, or the point failed), else the point waits in the worker for its
        rounds, ``on_checked`` gets its row as soon as it is checked (before a block of other
        points' rounds may run) and ``on_row`` its final row. Raises ``InvalidPoint`` for a bad
        value. ``journal`` (a path and this point's key) and ``prior`` go to ``prepare_point``."""
        self.next_id += 1
        request = ("prepare", self.next_id, point, root, trace_root, job_num, journal, prior)
        job = _Job(self.next_id, point, request, on_row, on_checked)
        return self._prepare(job)

    def _prepare(self, job: _Job) -> tuple[dict, float | None]:
        if self.busy:  # the last point's block of rounds found the machine busy: its row was
            self._stop(grace_s=5.0)  # returned; this one is not prepared
            self._stop_if_busy()
        while True:
            if not self._alive():
                self._start()
            job.stale, job.spent = False, 0.0  # prepared again after another's death: a fresh clock
            job.stage = _Job.stage
            try:
                with _signals_deferred():
                    self.conn.send(job.request)
                msg = self._wait(
                    lambda m: m[0] in ("prepared", "invalid") and m[1] == job.id, expect=job
                )
            except _Died as died:
                row = self._charge(died, job)
                if row is not None:
                    return row, None
                if died.status != "restart":  # a restart is nobody's fault
                    job.retries += 1  # it died under another point's call (a block's rounds): again
                if job.retries > RETRIES:
                    return self._failed_row(
                        _Died(
                            job,
                            died.status,
                            f"the worker died {job.retries} times "
                            f"while this point waited ({died.message})",
                        )
                    ), None
                continue
            # in a block's rounds its points keep theirs; compiling: killed
            except KeyboardInterrupt:
                self._stop(grace_s=5.0)
                raise
            if msg[0] == "invalid":
                from harness.config import InvalidPoint

                raise InvalidPoint(msg[2])
            row, rep_s = msg[2], msg[3]
            job.row = row  # a death in its rounds keeps its check's columns
            if rep_s is not None:
                self.waiting[job.id] = job
            return row, rep_s

    def rounds(self, say: Callable[[str], None] | None = None) -> None:
        """Time every point waiting in the worker; each gets its row through its ``on_row``.
        After a death in the rounds, the points still waiting are prepared again and timed."""
        if say is not None:
            self.say = say
        if self.busy:  # a block's rounds found the machine busy while the points were prepared
            self._stop()
            self._stop_if_busy()
        while self.waiting:
            for job in [j for j in self.waiting.values() if j.stale]:
                del self.waiting[job.id]
                row, rep_s = self._prepare(job)
                if rep_s is None:
                    job.on_row(row)
            if not self.waiting:
                break
            try:
                with _signals_deferred():
                    self.conn.send(("rounds",))
                self._wait(lambda m: m[0] == "idle")
                self._stop_if_busy()
            except _Died as died:
                self._charge(died, None)
                if died.job is None and died.status != "restart":
                    # not charged to anyone: do not retry the rest for ever
                    for job in list(self.waiting.values()):
                        job.retries += 1
                        if job.retries > RETRIES:
                            del self.waiting[job.id]
                            job.on_row(
                                self._failed_row(
                                    _Died(
                                        job,
                                        died.status,
                                        f"the worker died {job.retries} times ({died.message})",
                                    )
                                )
                            )
            except KeyboardInterrupt:
                self._stop()
                raise

    def _stop_if_busy(self) -> None:
        """Raise ``BusyStop`` (the sweep ends as on Ctrl-C, exit 3) where the worker said the
        machine was busy and ``timing.when_busy=stop``; the points waiting keep their checks."""
        if self.busy:
            from harness.errors import BusyStop

            self.busy = False
            raise BusyStop()

    def _stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """Ctrl-C: the worker ends the rounds it is in and hands back the rows of the points that
        have rounds; a second Ctrl-C, or a worker that does not answer within ``grace_s`` (it
        may be compiling), kills it."""
        if self.conn is None:
            self.waiting.clear()
            return
        try:
            self.conn.send(("stop",))
            deadline = time.monotonic() + grace_s
            while self.conn.poll(max(0.0, deadline - time.monotonic())):
                msg = self.conn.recv()
                if msg[0] == "row" and msg[1] in self.waiting:
                    self.waiting.pop(msg[1]).on_row(msg[2])
                elif msg[0] in ("idle", "prepared", "invalid", "restart"):
                    break
        except (KeyboardInterrupt, EOFError, OSError):
            pass
        self.kill()
        self.waiting.clear()


WORKER = Worker()
atexit.register(WORKER.close)
