"""How a run is stopped: SIGTERM and SIGHUP end it as Ctrl-C does (``stop_on_sigterm``), a stop
that comes while results.csv and the report are written waits for them (``Deferred``), and a stop
raised where Python would lose it is sent again (``_stop_again``). What a stopped run keeps and
says: harness/sweep/callbacks.py, ``stopped``.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

from harness.errors import Terminated


TERMINATING = (signal.SIGTERM, signal.SIGHUP)  # each ends a run as Ctrl-C does


def _terminate(signum, frame) -> None:
    # once: a second one must not cut the gathering short
    for sig in TERMINATING:
        signal.signal(sig, signal.SIG_IGN)
    raise Terminated(signum)


def stop_on_sigterm() -> None:
    """SIGTERM and SIGHUP end the run as Ctrl-C does (``Terminated`` is a KeyboardInterrupt):
    the points in their rounds hand back what they have, and what finished is gathered and
    reported."""
    for sig in TERMINATING:
        signal.signal(sig, _terminate)
    if not getattr(sys.unraisablehook, "stops_again", False):
        sys.unraisablehook = _stop_again(sys.unraisablehook)


class Deferred:
    """While results.csv and the report are written (``finish``), a stop waits for them: its
    first signal is noted and said, and the run exits with its code once they are written; a
    second one stops at once (what is on disk stays; ``mha-bench report`` renders it again)."""

    def __enter__(self) -> "Deferred":
        self.signum, self.old = None, {}
        for sig in (signal.SIGINT, *TERMINATING):
            try:
                self.old[sig] = signal.signal(sig, self._note)
            except ValueError:  # not the main thread: nothing to defer
                pass
        return self

    def _note(self, signum, frame) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt() if signum == signal.SIGINT else Terminated(signum)
        self.signum = signum
        print(
            f"\n{signal.Signals(signum).name}: writing results.csv and the report first "
            "(a few seconds); send it again to stop now",
            file=sys.stderr,
            flush=True,
        )

    def __exit__(self, kind, value, tb) -> None:
        for sig, handler in self.old.items():
            signal.signal(sig, handler)
        if self.signum is not None and (kind is None or kind is SystemExit):
            sys.exit(128 + self.signum)  # 130, 143, 129: as if it had stopped the run


def _stop_again(hook):
    """A stop raised where Python ignores exceptions (a weakref callback or ``__del__`` running
    when the signal came: torch frees tensors that way) is printed and lost, and the sweep ran on
    to exit 0 (tests/test_robustness.py's SIGTERM test, in 1 of 4 suite runs here). Such a stop
    is sent again from another thread a moment later (sent from here, it would be raised in
    here, where it is ignored too), to be raised in the code that runs then."""

    def handle(unraisable):
        exc = unraisable.exc_value
        if isinstance(exc, KeyboardInterrupt):
            if isinstance(exc, Terminated):
                signal.signal(exc.signum, _terminate)
            again = exc.signum if isinstance(exc, Terminated) else signal.SIGINT
            threading.Timer(0.01, os.kill, (os.getpid(), again)).start()
        else:
            hook(unraisable)

    handle.stops_again = True
    return handle
