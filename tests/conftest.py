"""Small builders shared by the tests. Tiny shapes everywhere: the suite runs on 2 CPU cores."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.store import register
from harness.envinfo import python_env

register()  # the config schema, for tests that compose conf/config.yaml in this process

if os.environ.get("PYTEST_XDIST_WORKER"):  # make test runs a worker per core (pytest -n)
    import torch

    torch.set_num_threads(1)  # one thread per worker: two workers' OpenMP threads would contend

REPO = Path(__file__).resolve().parent.parent
VARIANT_NAMES = sorted(p.stem for p in (REPO / "conf" / "variant").glob("*.yaml"))
# The ways of plain multi-head attention: every variant but latent attention's, which runs at
# kv_lora_rank > 0 only (tests/test_latent.py); the presets sweep them as this glob does.
PLAIN = "variant=glob(*,exclude=latent)"
WAYS = [n for n in VARIANT_NAMES if n != "latent"]
# Tiny and quick: a point takes milliseconds, a subprocess run a few seconds (imports).
TINY = [
    "batch=1",
    "seq_len=8",
    "embed_dim=16",
    "num_heads=2",
    "timing.warmup=0.001",
    "timing.rounds=3",
    "timing.round_time=0.001",
    # one torch thread: with two, a point's OpenMP threads spin-wait for each other when the
    # machine is busy, and a 0.1 ms call can take 10 ms (the suite must pass beside other work)
    "num_threads=1",
]


def harness_env(*paths, **env) -> dict:
    """The environment for ``python -m harness`` in a test: ``paths`` and the repository on
    PYTHONPATH, before the caller's own (kept: dependencies may come in through it), and
    ``env``'s other variables."""
    return python_env(*paths, REPO, env={**os.environ, **env})


def run_harness(*args: str, cwd: Path, env: dict | None = None, timeout: int = 300, paths=()):
    """``python -m harness ARGS`` in ``cwd`` (so results/ and reports/ land there), with ``paths``
    added to PYTHONPATH."""
    return subprocess.run(
        [sys.executable, "-m", "harness", *args],
        cwd=cwd,
        env=harness_env(*paths, **(env or {})),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture
def harness_cli(tmp_path):
    def run(*args: str, **kw):
        return run_harness(*args, cwd=tmp_path, **kw)

    return run


@pytest.fixture
def eager_flex(monkeypatch):
    """attention=flex uncompiled: the same mask semantics (block masks, score_mods), float64
    allowed, without inductor's compile per mask kind (seconds each on 2 cores). The checks of
    mask translation use it; tests/test_flex.py runs the compiled kernel the harness uses."""
    import warnings

    import variants.kernels.flex

    monkeypatch.setattr(variants.kernels.flex, "COMPILED", False)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile")
        yield


@pytest.fixture(scope="module")
def chromium():
    """A real headless Chromium (tests/browser.py), installed with apt-get when absent; the
    test skips, saying why, where it cannot be."""
    from tests import browser

    why = browser.ensure_chromium()
    if why:
        pytest.skip(why)
    drv = browser.driver()
    yield drv
    drv.quit()


@pytest.fixture
def copy(tmp_path):
    """This repository's files (tracked and new), copied: a place to add one line and run it."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    root = tmp_path / "repo"
    for name in listed:
        src = REPO / name
        if src.is_file():
            dst = root / name
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(src.read_bytes())
    return root
