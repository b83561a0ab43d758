"""``python tests/operator/act.py ACTION MOMENT [OVERRIDES...]``: ``mha-bench run OVERRIDES``
with an operator's ACTION done at MOMENT (issue 58's gallery, tests/test_operator_gallery.py).

The moment is a function of the sweep's own process, wrapped here: the action fires when it
is entered (``checks``: the second point's check, so one point is checked and one is not;
``rounds``: the timing rounds, when the first is done; ``gather``: results.csv being
written; ``rendering``: the report being drawn; ``composing``: Hydra reading a config file for
the second job, inside its own try/finally, whose cleanup then fails: a stop hidden under
another error, which a stop in the checks found by chance). What an operator would do from
outside is done from inside, at that moment and no other, so that each case happens every time
on a busy machine as on an idle one.

ACTION: ``pipe`` (stdout's reader goes away), ``SIGINT``, ``SIGTERM``, ``SIGHUP``, ``SIGKILL``
(sent to the sweep's process), ``disk`` (the filesystem of $ACT_MOUNT fills up), ``readonly``
(every directory under $ACT_DIR loses its write permission; the test runs the sweep without
root's power to write anyway). ``disk`` needs a tmpfs mounted there by the test. The test undoes
both before it resumes.
"""

import os
import signal
import sys
import threading

# where each moment is: (module, class or None, function), and how long after its start the
# action comes (a check or a round in progress; the gather and the rendering at once)
MOMENTS = {
    "checks": ("harness.sweep.worker", "Worker", "submit", 2, 0.05),
    "rounds": ("harness.sweep.worker", "Worker", "rounds", 1, None),  # at "round 1/N done"
    "gather": ("harness.sweep.callbacks", None, "write_results", 1, 0.0),
    "rendering": ("harness.report.render", None, "render_dir", 1, 0.0),
    "composing": None,  # Hydra's own code: ``composing``
}
ACTIONS = ("pipe", "SIGINT", "SIGTERM", "SIGHUP", "SIGKILL", "disk", "readonly")


def fill(mount: str) -> None:
    """Fill the filesystem at ``mount`` to its last byte (a file in it, written until ENOSPC)."""
    with open(os.path.join(mount, "filler"), "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass
        try:
            while True:
                f.write(b"\0")
        except OSError:
            pass


def writable(top: str, yes: bool) -> None:
    """Every directory under ``top`` made writable or not (chmod u+w / a-w): new files there
    (an atomic write's temporary, a new job's dir) are refused, as for a non-root user in a
    directory not theirs."""
    for where, _, _ in os.walk(top):
        mode = os.stat(where).st_mode
        os.chmod(where, mode | 0o200 if yes else mode & ~0o222)


def act(action: str) -> None:
    if action == "pipe":  # the reader of stdout went away: a pipe whose read end is closed
        sys.stdout.flush()
        read, write = os.pipe()
        os.close(read)
        os.dup2(write, sys.stdout.fileno())
    elif action == "disk":
        fill(os.environ["ACT_MOUNT"])
    elif action == "readonly":
        writable(os.environ["ACT_DIR"], False)
    else:
        os.kill(os.getpid(), getattr(signal, action))


def composing(action: str) -> None:
    """``action`` from inside the first config file Hydra opens for the second job: its reader
    (``_read_config``) opens it inside a ``try`` whose ``finally`` closes it."""
    import pathlib

    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    from harness.sweep.worker import Worker

    load, opened, submit = ConfigLoaderImpl.load_sweep_config, pathlib.Path.open, Worker.submit
    checked, armed = [0], [False]

    def submitted(self, *args, **kwargs):  # the first job's point, checked
        checked[0] += 1
        return submit(self, *args, **kwargs)

    def load_sweep_config(self, *args, **kwargs):
        armed[0] = checked[0] == 1  # the second job's config
        return load(self, *args, **kwargs)

    def open_(path, *args, **kwargs):
        if armed[0] and path.suffix == ".yaml":
            armed[0] = False
            act(action)
        return opened(path, *args, **kwargs)

    Worker.submit = submitted
    ConfigLoaderImpl.load_sweep_config = load_sweep_config
    pathlib.Path.open = open_


def at(moment: str, action: str) -> None:
    """Wrap the moment's function so that ``action`` fires on its n-th call, ``delay`` s in."""
    import importlib

    if moment == "composing":
        return composing(action)

    module, cls, name, nth, delay = MOMENTS[moment]
    owner = importlib.import_module(module)
    owner = getattr(owner, cls) if cls else owner
    original, calls = getattr(owner, name), [0]

    def wrapped(*args, **kwargs):
        calls[0] += 1
        if calls[0] == nth and delay is None:  # the rounds: when their progress says one is done
            say = kwargs.get("say") or (lambda text: None)
            done = [False]

            def said(text: str) -> None:
                say(text)
                if text.startswith("round 1/") and not done[0]:
                    done[0] = True
                    act(action)

            kwargs["say"] = said
        elif calls[0] == nth:
            if delay:
                threading.Timer(delay, act, (action,)).start()
            else:
                act(action)
        return original(*args, **kwargs)

    setattr(owner, name, wrapped)


if __name__ == "__main__":
    action, moment, *overrides = sys.argv[1:]
    assert action in ACTIONS and moment in MOMENTS, (action, moment)
    # Ctrl-C reaches a command run in the foreground. A suite started in the background by a
    # non-interactive shell passes SIGINT down ignored (POSIX), which the harness, like Python,
    # leaves ignored: the SIGINT cases then ran to exit 0. The operator's Ctrl-C is delivered.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    at(moment, action)
    from harness.cli import run
    from harness.leaving import leave

    sys.argv[1:] = overrides
    leave(run, overrides)
