"""The worker process's side of harness/sweep/worker.py's protocol: its loop (``serve``), which
prepares each point it is sent, keeps the sessions waiting for their rounds in its ``Pool`` and
times them when asked, forwarding its log lines and progress to the job process. Started as
``python -m harness.sweep.serve FD`` by ``Worker`` (harness/sweep/worker.py)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import signal
import sys
from multiprocessing.connection import Connection
from pathlib import Path


class _Forward(logging.Handler):
    def __init__(self, conn):
        super().__init__(logging.INFO)
        self.conn = conn

    def emit(self, record: logging.LogRecord) -> None:
        self.conn.send(("log", record.levelno, record.getMessage()))


def _die_with_parent() -> None:
    """A worker must not outlive its job process (SIGKILLed sweeps included)."""
    try:
        import ctypes

        parent = os.getppid()
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # it died before the line above
            os._exit(1)
    except (OSError, AttributeError):
        pass  # not Linux: the end of input on the pipe still ends it


@contextlib.contextmanager
def _unclocked(conn, jid):
    conn.send(("pause", jid))
    try:
        yield
    finally:
        conn.send(("resume", jid))


def serve(conn) -> None:
    """The worker's loop: prepare points, keep their sessions, time them when asked."""
    _die_with_parent()
    # Stopping is the job process's to decide: it asks ("stop") and gets the rows the rounds
    # have. A cluster's SIGTERM reaches every process of the job, this one included.
    for stop in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # a closed terminal: SIGHUP
        signal.signal(stop, signal.SIG_IGN)
    kind, path = conn.recv()
    assert kind == "init"
    sys.path[:] = path
    harness_log = logging.getLogger("harness")
    harness_log.handlers[:] = [_Forward(conn)]
    harness_log.setLevel(logging.INFO)
    harness_log.propagate = False

    from harness.config import InvalidPoint
    from harness.errors import BrokenDevice, BusyStop, broke_device
    from harness.fingerprint import Fingerprint, World, said
    from harness.outcome import Verdict
    from harness.point import Shelf, base_record, prepare_point
    from harness.measure.journal import journal_at
    from harness.measure.roofline import PeakBook
    from harness.results import PEAK_FILE
    from harness.measure.rounds import Pool

    pool = Pool(
        say=lambda text: conn.send(("say", text)),
        on_visit=lambda s, r: conn.send(("visit", s.tag, r)),
        stop=conn.poll,
    )
    books: dict = {}
    # torch as this worker found it, and the yardsticks of the shape it is at (computed with
    # torch as found): a point that changes torch's functions is its own last point here
    fingerprint = Fingerprint.take()
    shelf = Shelf(fingerprint)
    # what each variant changed of torch (harness/fingerprint.py): its own calls only
    worlds: dict[str, World] = {}
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg[0] == "prepare":
            _, jid, point, root, trace_root, job_num, journal, prior = msg
            conn.send(("begin", jid, base_record(point)))
            try:  # before its check and its graph: the waiting points first where it would not fit
                pool.make_room(point)
            except BusyStop:  # timing.when_busy=stop: the job process ends the sweep
                conn.send(("busy",))
            except KeyboardInterrupt:
                pass  # "stop" during those rounds: they have their rows
            except BrokenDevice as e:
                return _restart(conn, str(e))  # the job sends this point to the next worker
            peaks = (
                None if root is None else books.setdefault(root, PeakBook(Path(root) / PEAK_FILE))
            )
            if peaks is not None:
                peaks.around = functools.partial(_unclocked, conn, jid)
            # per class: what one class's points change is never another's (a module's import
            # is the world of the class whose point imported it first)
            world = worlds.setdefault(point.variant.target, World(fingerprint))
            try:
                with world.entered():  # a library's patches of torch, for its own points only
                    record, session = prepare_point(
                        point,
                        peaks,
                        trace_root,
                        job_num,
                        done=lambda r, jid=jid: conn.send(("row", jid, _with_restart_note(r))),
                        journal=journal and (journal_at(journal[0]), journal[1]),
                        prior=prior,
                        shelf=shelf,
                    )
            except InvalidPoint as e:
                conn.send(("invalid", jid, str(e)))
                if fingerprint.changed():  # its import changed torch before it was refused
                    return _restart(conn, "a point changed torch's functions", sticky=False)
                continue
            if world.names:  # its world: said in its row, run for its calls alone
                record.outcome = dataclasses.replace(
                    record.outcome, torch_changed=said(world.names)
                )
            # what could not be put back: torch not as found (never yet: worlds put it back), or
            # a thread or process the variant left running beside every later call (which
            # changes no check: under check_only it only replaces the worker, which ends them)
            left = [f"a thread it started ({name})" for name in fingerprint.new_threads()] + [
                f"a process it started ({p})" for p in fingerprint.new_processes()
            ]
            changed = fingerprint.changed() + ([] if point.check_only else left)
            if changed:  # nothing timed here would be what it claims: not timed, and replaced
                record.settle(Verdict("unsupported", changed_torch(said(changed))))
                record.outcome = dataclasses.replace(
                    record.outcome, torch_changed=said(world.names + changed)
                )
                session = None
            broken = broke_device(record)
            if broken and session is not None:  # its profiling pass broke the device
                record.settle(Verdict("error", record.profile.profile_error))
                session = None
            if session is not None:
                session.tag, session.world = jid, world
                # on disk before a block's rounds may run in pool.add
                conn.send(("checked", jid, record))
                try:
                    pool.add(session)  # may time a block first (timing.resident_mb)
                except BusyStop:
                    conn.send(("busy",))
                except KeyboardInterrupt:
                    pass  # "stop" during a block's rounds: those points have their rows
                except BrokenDevice as e:
                    broken = str(e)
                    if session.failure is not None:  # its own capture: its row, not retried
                        record.settle(Verdict(*session.failure[:2]))
                        session = None
            conn.send(("prepared", jid, _with_restart_note(record), session and session.rep_s))
            if broken:
                return _restart(conn, record.outcome.error if broken is True else broken)
            if changed or left:
                name = record.identity.variant
                return _restart(conn, f"{name} left {said(changed or left)} behind", sticky=False)
            if pool.replace:  # the points waiting here are prepared again in a fresh worker
                return _restart(conn, pool.replace, sticky=False)
        elif msg[0] == "env":  # env.json's facts, from the torch that measures (Worker.ask)
            from harness.envinfo import environment

            conn.send(("env", environment()))
        elif msg[0] == "ways":  # what the kernels and structures named declare (Worker.ask)
            from harness.sweep.facts import definitions

            conn.send(("ways", definitions(*msg[1:])))
        elif msg[0] == "rounds":
            try:
                pool.run()
            except BusyStop:  # timing.when_busy=stop: the job process ends the sweep
                conn.send(("busy",))
            except KeyboardInterrupt:
                pass  # asked to stop: the points with rounds were handed their rows
            except BrokenDevice as e:
                return _restart(conn, str(e))
            while conn.poll():  # a "stop" that came after the last repetition
                conn.recv()
            if pool.replace:  # the rows are sent: the next point starts in a fresh worker
                return _restart(conn, pool.replace, sticky=False)
            conn.send(("idle",))


def changed_torch(what: str) -> str:
    """Why a point whose variant left something behind that cannot be put back (a thread it
    started; torch's functions changed beyond its world) is not timed: its time beside nn.MHA
    would not be measured against nn.MHA. ``unsupported`` where its check passed; a failed check
    keeps its verdict (harness/outcome.py)."""
    return (
        f"it left {what} behind, which nn.MultiheadAttention and every point after it in this "
        "worker would have run beside: not timed; the worker was replaced before the next point"
    )


def _with_restart_note(record):
    """A record whose failure broke the device says that the worker was replaced."""
    from harness.errors import RESTARTED, broke_device

    return record.note(RESTARTED) if broke_device(record) else record


def _restart(conn, text: str, sticky: bool = True) -> None:
    """After a sticky CUDA error, or a point that changed torch, nothing more should run here:
    say so, then only wait for the job process to end this one (it reads the message before
    anything sent after it). ``sticky``: it was a sticky CUDA error, which the message names."""
    conn.send(("restart", f"a sticky CUDA error: {text}" if sticky else text))
    try:
        while True:
            conn.recv()
    except (EOFError, OSError):
        return


if __name__ == "__main__":  # python -m harness.sweep.serve FD (started by Worker._start)
    serve(Connection(int(sys.argv[1])))
