"""Open a run's or sweep's profiler traces in TensorBoard (torch-tb-profiler), on loopback.

    python -m harness.tensorboard results/sweeps/<date_time>     # or: make tensorboard DIR=...

Starts ``tensorboard --logdir <dir>/traces --host 127.0.0.1 --port <free port>`` and prints
the URL of the PyTorch Profiler tab; one TensorBoard run per sweep point. Ctrl-C stops it.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import signal
import ctypes
import os
import shlex
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

from harness.progress import headline

PLUGIN = "pytorch_profiler"
TRACE_GLOB = "*.pt.trace.json"


def trace_root(path: Path) -> Path:
    """``<dir>/traces`` when there is one (a run or sweep dir), else ``path`` itself."""
    return path / "traces" if (path / "traces").is_dir() else path


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def start(
    logdir: Path, host: str = "127.0.0.1", port: int | None = None
) -> tuple[subprocess.Popen, str]:
    """Start TensorBoard on ``logdir``; return the process and its base URL."""
    port = port or free_port(host)
    log = tempfile.TemporaryFile(mode="w+")  # read on failure; a pipe nobody read could fill
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tensorboard.main",
            "--logdir",
            str(logdir),
            "--host",
            host,
            "--port",
            str(port),
            "--reload_interval",
            "5",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=_dies_with_parent,
    )
    proc.log = log
    return proc, f"http://{host}:{port}"


def _dies_with_parent() -> None:
    """In the child: SIGTERM when the command that started it dies, however it dies (Linux's
    PR_SET_PDEATHSIG; elsewhere nothing): a killed ``mha-bench tensorboard`` left TensorBoard
    listening."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def _output(proc) -> str:
    proc.log.seek(0)
    return proc.log.read()[-2000:]


# The loopback, asked directly: an http_proxy in the environment without a no_proxy for
# 127.0.0.1 sent the readiness polls to the proxy, and TensorBoard "never" came up.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def plugin_runs(base: str, timeout: float = 2.0) -> dict | None:
    """The profiler plugin's run list ({'runs': [...], 'loading': bool}), or None if not up yet."""
    try:
        with _DIRECT.open(f"{base}/data/plugin/{PLUGIN}/runs", timeout=timeout) as r:
            return json.loads(r.read())
    except (OSError, ValueError):
        return None


def wait_ready(proc: subprocess.Popen, base: str, n_runs: int, timeout: float = 120.0) -> list[str]:
    """Poll until the plugin lists at least ``n_runs`` runs and has stopped loading."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"tensorboard exited with {proc.returncode}: {_output(proc)}")
        data = plugin_runs(base)
        if data and len(data["runs"]) >= n_runs and not data["loading"]:
            return data["runs"]
        time.sleep(0.5)
    raise TimeoutError(
        f"the {PLUGIN} plugin did not list {n_runs} runs at {base} within {timeout:.0f} s"
    )


def command(root) -> str:
    """The command that opens ``root``'s traces, quoted for a shell (a directory named
    ``x$(touch PWNED)`` is a name there, not a command)."""
    return f"mha-bench tensorboard {shlex.quote(str(root))}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mha-bench tensorboard", description=headline(__doc__))
    parser.add_argument("dir", help="a run or sweep dir run with profile=true (or its traces/ dir)")
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default: loopback)"
    )
    parser.add_argument("--port", type=int, default=None, help="port (default: a free one)")
    args = parser.parse_args(argv)
    path = Path(args.dir)
    if not path.is_dir():
        print(f"error: {args.dir!r} is not a directory", file=sys.stderr)
        return 2
    logdir = trace_root(path)
    runs = sorted({p.parent for p in logdir.rglob(TRACE_GLOB)})
    if not runs:
        print(
            f"error: no profiler traces ({TRACE_GLOB}) under {str(logdir)!r}: run the sweep with "
            "profile=true",
            file=sys.stderr,
        )
        return 2
    for stop in (signal.SIGTERM, signal.SIGHUP):  # as Ctrl-C: TensorBoard is stopped too
        signal.signal(stop, _stopped)
    proc, base = start(logdir, args.host, args.port)
    print(f"tensorboard: {len(runs)} runs from {logdir}")
    code = 0
    try:
        wait_ready(proc, base, len(runs))
        print(f"open: {base}/#{PLUGIN}   (Ctrl-C to stop)", flush=True)
        proc.wait()
    except KeyboardInterrupt as e:
        code = 128 + e.args[0] if isinstance(e, _Stop) else 0  # 143, 129; Ctrl-C: 0
    except (RuntimeError, TimeoutError) as e:
        print(f"error: {e}", file=sys.stderr)
        code = 1
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
    return code


class _Stop(KeyboardInterrupt):
    """SIGTERM or SIGHUP: stops as Ctrl-C does (its number in ``args``)."""


def _stopped(signum, frame) -> None:
    raise _Stop(int(signum))


if __name__ == "__main__":
    sys.exit(main())


def trace_link(root: Path, trace_dir: str, link_from: Path) -> str:
    """A point's trace dir as a relative URL from ``link_from``, percent-encoded (a cell of
    ``javascript:...`` is a file name there, never a scheme the browser runs); "" (no link) for
    one that is not under ``root``: a results.csv is data, not a list of places to send a reader."""
    target = (root / trace_dir).resolve()
    if not target.is_relative_to(root.resolve()):
        return ""
    return "./" + urllib.parse.quote(os.path.relpath(target, start=link_from.resolve()))


def profile_rows(df, root: Path, link_from: Path) -> list[dict]:
    """Per-point profile summaries of ``df`` (the report's rows, a DataFrame), with a link to each
    point's trace dir from ``link_from`` (``trace_link``)."""
    if "trace_dir" not in df.columns:
        return []
    rows = []
    for r in df[df["trace_dir"].notna()].to_dict("records"):
        rows.append(
            {
                "label": r["way"],
                "case": r["shape"],
                "ops_per_call": r.get("ops_per_call"),
                "copies_per_call": r.get("copies_per_call"),
                "kernels_per_call": r.get("kernels_per_call"),
                "top_ops": r.get("top_ops"),
                "link": trace_link(root, str(r["trace_dir"]), link_from),
                "trace_dir": r["trace_dir"],
            }
        )
    return rows
