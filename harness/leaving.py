"""How every command leaves (``leave``): its exit code, out without the interpreter's teardown,
an input that is not what it should be said in one line, and stdout that outlives its reader
(``PipeGuard``). Ground: the command line (harness/cli.py) and every command's ``python -m``
form use it; torch-free.
"""

from __future__ import annotations

import os
import sys


class PipeGuard:
    """stdout that outlives its reader: ``mha-bench run -m ... | head -2`` closes the pipe after
    two lines, and the sweep goes on (its rows, results.csv and the report are files); what it
    would have printed is dropped, the file descriptor pointed at /dev/null so that nothing
    later (a flush at exit, a logging handler) meets the closed pipe either."""

    def __init__(self, stream):
        self.stream, self.reader_gone = stream, False

    def write(self, text: str) -> int:
        if not self.reader_gone:
            try:
                return self.stream.write(text)
            except BrokenPipeError:
                self._gone()
        return len(text)

    def flush(self) -> None:
        if not self.reader_gone:
            try:
                self.stream.flush()
            except BrokenPipeError:
                self._gone()

    def _gone(self) -> None:
        self.reader_gone = True
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), self.stream.fileno())
        except (OSError, ValueError):
            pass

    def __getattr__(self, name):
        return getattr(self.stream, name)


def leave(command, *args) -> None:
    """``command(*args)``'s exit code, out without the interpreter's teardown of torch, pandas
    and Hydra (most of a second at the end of every command; a one-point check is a few seconds
    in all). Everything is written by then; the exit handlers still run first (the worker is
    ended, logs flushed), then stdout and stderr are flushed. An exception leaves as usual,
    with its traceback. stdout is guarded against a reader that goes away (``PipeGuard``)."""
    if not isinstance(sys.stdout, PipeGuard):
        sys.stdout = PipeGuard(sys.stdout)
    from harness.results import DamagedFile  # torch-free

    try:
        code = command(*args)
    except SystemExit as e:
        code = e.code
    except DamagedFile as e:  # an input that is not what it should be: a refusal, one line
        print(f"error: {e}", file=sys.stderr)
        code = 2
    if code is not None and not isinstance(code, int):  # sys.exit("message")
        print(code, file=sys.stderr)
        code = 1
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can reach it
            pass
    os._exit(code or 0)
