"""The machine and software a result was measured on: env.json at the run/sweep root, and the
key fields as columns of every row."""

from __future__ import annotations

import functools
import logging
import os
import platform
import shutil
import socket
import subprocess
import sys
import sysconfig
from pathlib import Path

from harness.validate import InvalidPoint


REPO = Path(__file__).resolve().parent.parent


def python_env(*paths: str | os.PathLike, env: dict | None = None) -> dict:
    """The environment for a Python subprocess that must also import from ``paths``: they go
    first, and the caller's PYTHONPATH stays after them, never replaced (where the dependencies
    come in through it, as on a bare GPU image, the subprocess would not find them)."""
    out = dict(os.environ if env is None else env)
    kept = out.get("PYTHONPATH", "")
    out["PYTHONPATH"] = os.pathsep.join([*(str(p) for p in paths), *([kept] if kept else [])])
    return out


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git(*args: str) -> str:
    try:
        out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=5)
        return out.stdout.strip() if out.returncode == 0 else ""
    except (OSError, subprocess.SubprocessError):
        return ""


def _driver() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return (
            out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ""
        )
    except (OSError, subprocess.SubprocessError):
        return ""


_KNOWN: dict = {}  # environment()'s facts, once found or adopted


def environment() -> dict:
    """The machine and software (env.json), found once per process, or adopted from the worker
    that measures (``adopt``): only this reads torch's CUDA facts."""
    if not _KNOWN:
        _KNOWN.update(_found())
    return _KNOWN


def adopt(env: dict) -> None:
    """``environment()`` as a point's worker found it (harness/sweep/worker.py): the same
    machine, its torch and its CUDA devices, without importing torch here."""
    _KNOWN.clear()
    _KNOWN.update(env)


def _found() -> dict:
    import torch

    cuda = torch.cuda.is_available()
    commit = _git("rev-parse", "HEAD")
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no")) if commit else False
    return {
        "torch": str(torch.__version__),  # a plain str: a TorchVersion unpickles by importing torch
        "cuda": torch.version.cuda or "",
        "cudnn": str(torch.backends.cudnn.version() or "") if cuda else "",
        "driver": _driver() if cuda else "",
        "gpu_count": torch.cuda.device_count() if cuda else 0,
        "driver_gpu_count": driver_gpus(),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "gpu_names": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if cuda
        else [],
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "available_cores": available_cores(),
        "load_at_start": load_average(),
        # the rows' own: num_threads, env "threads_used"
        "torch_threads_default": torch.get_num_threads(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
        "git_commit": commit + ("-dirty" if dirty else "") if commit else "unknown",
    }


DRIVER_GPUS = Path("/proc/driver/nvidia/gpus")  # one directory per GPU the driver has (Linux)


@functools.lru_cache(maxsize=1)
def driver_gpus() -> int:
    """GPUs the NVIDIA driver has, whatever CUDA_VISIBLE_DEVICES lets torch see."""
    try:
        return sum(1 for _ in DRIVER_GPUS.iterdir())
    except OSError:
        return 0


def gpus_hidden() -> int:
    """GPUs the driver has that torch does not see: submitit's local launcher starts its jobs
    with CUDA_VISIBLE_DEVICES="" unless asked for GPUs, and a CPU-only torch sees none."""
    return max(0, driver_gpus() - environment()["gpu_count"])


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        import torch

        try:
            return torch.cuda.get_device_name(torch.device(device))
        except (RuntimeError, AssertionError, ValueError):  # no CUDA, or no such GPU: unsupported
            return ""
    return _cpu_model()


def env_columns(device: str) -> dict:
    env = environment()
    return {
        "device_name": device_name(device),
        "gpus_hidden": gpus_hidden(),
        "torch_version": env["torch"],
        "cuda_version": env["cuda"],
        "git_commit": env["git_commit"],
        "hostname": env["hostname"],
    }


def sees_cuda() -> bool:
    """Whether torch sees a GPU here: asked of torch where it is imported (a point's worker),
    else read from the worker's facts (``environment``, adopted), so that the sweep's own
    process need not import torch to resolve ``device=auto``."""
    torch = sys.modules.get("torch")
    return torch.cuda.is_available() if torch else environment()["gpu_count"] > 0


def resolve_device(device) -> str:
    if device == "auto":
        if sees_cuda():
            return "cuda"
        warn_cpu_despite_gpus()
        return "cpu"
    if (
        device == "cpu"
        or device == "cuda"
        or (isinstance(device, str) and device.startswith("cuda:") and device[5:].isdigit())
    ):
        return device
    raise InvalidPoint(f"device={device!r} is not one of auto|cpu|cuda|cuda:N")


@functools.lru_cache(maxsize=1)
def warn_cpu_despite_gpus() -> None:
    """device=auto chose the CPU on a machine whose driver has GPUs: say so once per process
    (the rows say it in gpus_hidden)."""
    if driver_gpus():
        logging.getLogger("harness").warning(
            f"warning: device=auto runs on the CPU, but the NVIDIA driver has {driver_gpus()} "
            f"GPU(s) that torch does not see (CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}, torch {environment()['torch']}); "
            "ask for device=cuda to make it an error"
        )


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))  # the cores this process may run on
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def default_threads(device: str) -> int:
    """``num_threads=null``: on a CPU half the cores this process may use (one at least), so that
    one busy process beside the run leaves its threads a core each and its rounds stay clean
    (docs/methodology.md, "How a point is timed"; num_threads=N uses N); on a GPU every core
    (the host only launches)."""
    cores = available_cores()
    return cores if device.startswith("cuda") else max(1, cores // 2)


def threads_said(threads: list[int], cores: int) -> str:
    """The CPU threads the points ran with beside the cores, and why when it is the default
    (``default_threads``): "num_threads=1 of 2 cores (half: ...)". Said by the rounds' first
    line and by the report."""
    if not threads:
        return ""
    said = f"num_threads={'/'.join(map(str, threads))} of {cores} cores"
    if max(threads) > cores:
        said += (
            " (more threads than cores: they wait for one another, and the rounds read as "
            f"contended; num_threads={max(1, cores // 2)} is the default here)"
        )
    elif threads == [max(1, cores // 2)] and threads[0] < cores:
        said += (
            " (the default, half the cores: one busy process beside the run leaves them a core "
            "each; num_threads=N to change)"
        )
    return said


def load_average() -> float | None:
    """The machine's 1-minute load average (None where the platform has none)."""
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


# Set by the sweeper (hydra_plugins/mha_bench/sweeper.py) to the GPUs the sweep saw, for
# ``inherit_gpus`` in its submitit_local jobs.
PARENT_GPUS = "MHA_BENCH_PARENT_GPUS"


def inherit_gpus(environ=os.environ) -> str | None:
    """In a submitit_local job: its CUDA_VISIBLE_DEVICES as the submitting process meant it.
    submitit hands a job GPUs 0..n-1, indices into the list the sweep saw, but CUDA reads them
    as the machine's own first n; with the sweep's list (PARENT_GPUS, set by the sweeper) they
    are mapped back through it before CUDA starts. Returns the list set, or None."""
    parent, given = environ.get(PARENT_GPUS), environ.get("CUDA_VISIBLE_DEVICES")
    if not parent or given is None or environ.get("SUBMITIT_EXECUTOR") != "local":
        return None
    mine = [d for d in parent.split(",") if d]
    try:
        meant = [mine[int(i)] for i in given.split(",") if i]
    except (ValueError, IndexError):
        return None  # already mapped (a resumed job), or not submitit's numbering
    environ["CUDA_VISIBLE_DEVICES"] = ",".join(meant)
    return environ["CUDA_VISIBLE_DEVICES"]


def use_device(device: str) -> None:
    """Make ``cuda:N`` the current device: CUDA events, graph capture, synchronize and
    ``torch.cuda`` queries without an index act on the current device, GPU 0 unless set, while a
    point's tensors live on GPU N."""
    if device.startswith("cuda:"):
        import torch  # only where a point runs: the report reads this module without torch

        torch.cuda.set_device(torch.device(device))


def where_command(name: str = "mha-bench", scripts: str | None = None, path: str | None = None):
    """Where pip put the command ``name`` for this Python (its scripts folder), and how to call
    it, in one line: on the PATH, or its full path and the folder to add (a venv not activated,
    ``PYTHON=...``), or another ``name`` that comes first on the PATH. scripts/setup.sh says it."""
    folder = Path(scripts or sysconfig.get_path("scripts"))
    exe = folder / name
    if not exe.exists():
        return f"{name} is not in {folder}: call it as {sys.executable} -m harness"
    found = shutil.which(name, path=path)
    if found and Path(found).resolve() == exe.resolve():
        return f"{name} is {exe}, on your PATH: try `{name} --help`"
    first = f" ({found} comes first there)" if found else ""
    return (
        f"{name} is {exe}, not on your PATH{first}: call it as {exe}, or add {folder} to PATH "
        "(or activate its venv)"
    )
