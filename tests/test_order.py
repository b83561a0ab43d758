"""A point's verdict is its own (docs/architecture.md, "Invariants"): nothing a point leaves
behind changes the next one's check.

- The yardsticks of a shape (harness/way/yardsticks.py) hold nothing a way decides: a decode
  point's activation-scale check runs with its own KV-cache style, whatever point came before.
- As a property: correct and wrong modules (the negative gallery's, and the faulty gallery's that
  return) at shared shapes, checked one after another as a worker does (one ``Shelf``), forward,
  reversed, and each alone, give the same check columns to the bit.
- A variant that changes torch's functions on import is caught by the worker's fingerprint
  (harness/fingerprint.py): it is not timed, its row says what it changed, the worker is
  replaced, and the points after it read nn.MultiheadAttention's own speed (a real sweep).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
import yaml

from harness.factory import make_point
from harness.fingerprint import Fingerprint
from harness.point import Shelf, prepare_point
from tests.conftest import REPO, run_harness

NEGATIVE, FAULTY = REPO / "tests" / "negative", REPO / "tests" / "faulty"
for folder in (NEGATIVE, FAULTY):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))  # the galleries' modules, as PYTHONPATH would

# The check's columns a verdict is made of: what must not depend on the points before.
VERDICT = (
    "status",
    "error",
    "failed_scale",
    "diagnosis",
    "worst_tensor",
    "max_abs_err",
    "ref_err",
    "tolerance",
    "act_check",
    "act_scale",
    "act_err_ratio",
    "fp32_check",
    "wrong_where",
)

# Two decode modules written outside this repository: one whose static cache writes one slot
# early (its concat path is right), one right in both.
OUTSIDE = """
from variants.cache import StaticCache
from variants.separate import SeparateProjMHA


class OneSlotEarly(StaticCache):
    def update(self, k, v):
        start = max(self.length - 1, 0)
        self.k[:, :, start : start + k.size(2)] = k
        self.v[:, :, start : start + k.size(2)] = v
        self.pending = end = self.length + k.size(2)
        return self.k[:, :, :end], self.v[:, :, :end]


class Right(SeparateProjMHA):
    pass


class StaticWrong(SeparateProjMHA):
    def new_cache(self, style, batch, capacity, device, dtype):
        if style == "static":
            return OneSlotEarly(batch, self.num_kv_heads, capacity, self.head_dim, device, dtype)
        return super().new_cache(style, batch, capacity, device, dtype)
"""


@pytest.fixture(scope="module")
def outside(tmp_path_factory):
    folder = tmp_path_factory.mktemp("outside")
    (folder / "decode_modules.py").write_text(OUTSIDE)
    sys.path.insert(0, str(folder))
    yield folder
    sys.path.remove(str(folder))


def point(variant: dict, name: str, **keys):
    """A tiny CPU point of ``variant`` (a yaml's content), checked only."""
    shape = dict(batch=2, seq_len=6, embed_dim=16, num_heads=4, device="cpu", check_only=True)
    p = make_point("fused", variant=variant, **{**shape, **keys})
    return dataclasses.replace(p, variant=dataclasses.replace(p.variant, name=name))


def ours(target: str) -> dict:
    return {"_target_": target, "attention": "sdpa", "merge": "view"}


def checked(points, shelf: Shelf | None) -> list[dict]:
    """Each point's verdict columns, checked one after another on ``shelf`` (None: each on a
    shelf of its own, as if alone)."""
    out = []
    for p in points:
        record, session = prepare_point(p, shelf=shelf)
        assert session is None  # check_only
        out.append({k: record.columns()[k] for k in VERDICT})
    return out


def same(a: dict, b: dict) -> bool:
    """Equal to the bit (NaN equal to NaN)."""
    return all(
        x == y
        or (isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y))
        for x, y in ((a[k], b[k]) for k in VERDICT)
    )


def test_a_decode_points_activation_scale_check_uses_its_own_cache_style(outside):
    decode = dict(seq_len=2, kv_cache_len=6)
    right, wrong = ours("decode_modules.Right"), ours("decode_modules.StaticWrong")
    right_static = point(right, "right", kv_cache="static", **decode)
    wrong_concat = point(wrong, "wrong", kv_cache="concat", **decode)
    wrong_static = point(wrong, "wrong", kv_cache="static", **decode)
    shelf = Shelf()
    after = checked([right_static, wrong_concat], shelf)[1]
    alone = checked([wrong_concat], None)[0]
    # before: the concat point ran its static path at activation scale (the first point's
    # style, kept with the scaled inputs) and read as a mismatch there
    assert after["status"] == alone["status"] == "ok", after["error"]
    assert same(after, alone)
    # and its static path is caught, whatever came before
    assert checked([wrong_static], shelf)[0]["status"] == "mismatch"


def gallery():
    """(name, point) pairs at three shared shapes: every correct structure and the known
    mistakes that show there (tests/negative), and the faulty gallery's modules that return."""
    shapes = {
        "plain": dict(mask="causal", mode="fwd_bwd"),
        "grouped": dict(num_kv_heads=2, mask="sliding", window=3),
        "decode": dict(seq_len=2, kv_cache_len=5, num_kv_heads=2),
    }
    wrong = {
        "plain": ["no_permute", "sqrt_embed_dim", "mask_not_applied", "key_detached", "textbook"],
        "grouped": ["gqa_tiled", "window_one_wide"],
        "decode": ["cache_one_off"],
    }
    faulty = ["float64_out", "mutates_query", "mutates_mask", "leaks_outputs"]
    correct = {
        name: ours(f"variants.{name}.{cls}")
        for name, cls in (
            ("fused", "FusedQKVMHA"),
            ("separate", "SeparateProjMHA"),
            ("packed", "PackedHeadsMHA"),
        )
    }
    out = []
    for shape, keys in shapes.items():
        ways = dict(correct)
        ways.update(
            {
                n: yaml.safe_load((NEGATIVE / "variant" / f"{n}.yaml").read_text())
                for n in wrong[shape]
            }
        )
        if shape == "plain":
            ways.update(
                {n: yaml.safe_load((FAULTY / "variant" / f"{n}.yaml").read_text()) for n in faulty}
            )
        if shape == "decode":
            ways["cache_kept"] = ours("mistakes.CacheKept")
        for name, variant in ways.items():
            for style in ("static", "concat") if shape == "decode" else ("static",):
                out.append(
                    (f"{name} {shape} {style}", point(variant, name, kv_cache=style, **keys))
                )
    return out


def test_order_independence_forward_reversed_and_alone():
    cases = gallery()
    names = [n for n, _ in cases]
    points = [p for _, p in cases]
    forward = dict(zip(names, checked(points, Shelf())))
    backward = dict(zip(reversed(names), checked(list(reversed(points)), Shelf())))
    alone = dict(zip(names, checked(points, None)))
    differ = [
        f"{n}: forward {forward[n]['status']} {forward[n]['error']!r:.120}, reversed "
        f"{backward[n]['status']}, alone {alone[n]['status']}"
        for n in names
        if not (same(forward[n], alone[n]) and same(backward[n], alone[n]))
    ]
    assert not differ, "\n".join(differ)
    statuses = {r["status"] for r in alone.values()}
    assert {"ok", "mismatch"} <= statuses  # the property is over right and wrong modules


# --- a variant that changes torch ----------------------------------------------------------


def test_the_fingerprint_names_a_patch_and_puts_torch_back_for_the_yardsticks():
    print_ = Fingerprint.take()
    original = torch.nn.MultiheadAttention.forward
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def wrapped(self, *args, **kwargs):
        return original(self, *args, **kwargs)

    try:
        torch.nn.MultiheadAttention.forward = wrapped
        torch.nn.functional.scaled_dot_product_attention = lambda *a, **k: sdpa(*a, **k) * 2
        assert set(print_.changed()) == {
            "torch.nn.MultiheadAttention.forward",
            "torch.nn.functional.scaled_dot_product_attention",
        }
        with print_.as_found():
            assert torch.nn.MultiheadAttention.forward is original
            assert torch.nn.functional.scaled_dot_product_attention is sdpa
            assert print_.changed() == []
        assert torch.nn.MultiheadAttention.forward is wrapped  # the point's own, put back
    finally:
        torch.nn.MultiheadAttention.forward = original
        torch.nn.functional.scaled_dot_product_attention = sdpa
    assert print_.changed() == []


PATCHING = """
import torch
from variants.fused import FusedQKVMHA

_forward = torch.nn.MultiheadAttention.forward


def _slow(self, *args, **kwargs):  # what a library's wrapper might cost: 20x the call
    for _ in range(19):
        _forward(self, *args, **kwargs)
    return _forward(self, *args, **kwargs)


torch.nn.MultiheadAttention.forward = _slow  # on import, as some libraries do


class Patching(FusedQKVMHA):
    pass
"""


def test_a_variant_that_patches_torch_runs_in_its_own_world_and_no_other_point_sees_it(
    tmp_path,
):
    """Issue 73: a library that patches torch on import (lightning replaces torch.compile) is
    part of that module's world: its points are checked and timed with it, nn.MHA's calls and
    the next point's without it, and its rows name what it changed."""
    (tmp_path / "patching.py").write_text(PATCHING)
    (tmp_path / "variant").mkdir()
    (tmp_path / "variant" / "patching.yaml").write_text(
        "_target_: patching.Patching\nattention: sdpa\nmerge: view\n"
    )
    (tmp_path / "variant" / "plain.yaml").write_text(
        "_target_: variants.fused.FusedQKVMHA\nattention: sdpa\nmerge: view\n"
    )
    out = tmp_path / "sweep"
    proc = run_harness(
        "-m",
        "--config-dir",
        str(tmp_path),
        "variant=reference,patching,plain",
        "seq_len=64",
        "timing.rounds=3",
        "timing.round_time=0.01",
        f"hydra.sweep.dir={out}",
        f"report_dir={tmp_path / 'reports'}",
        cwd=tmp_path,
        paths=(tmp_path,),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = pd.read_csv(out / "results.csv").set_index("variant")
    patching = rows.loc["patching"]
    assert patching["status"] == "ok", patching["error"]
    assert patching["torch_changed"] == "torch.nn.MultiheadAttention.forward"
    # timed beside nn.MHA at its own speed: the patch (20x nn.MHA's cost) is not in nn.MHA's
    # repetitions, which interleave with its own in the same rounds
    assert 0.2 < patching["speedup"] < 5, patching["speedup"]
    # the way after it, in the same worker: nn.MHA at its own speed beside it (with the patch
    # nn.MHA would be 20x slower and this way read about 20x nn.MHA's speed)
    plain = rows.loc["plain"]
    assert plain["status"] == "ok" and pd.isna(plain.get("torch_changed"))
    assert 0.2 < plain["speedup"] < 5, plain["speedup"]
    assert "replaced" not in proc.stdout + proc.stderr  # no worker was replaced for it


STAND_IN = """
import torch
from variants.fused import FusedQKVMHA

_compile = torch.compile


def compile(*args, **kwargs):  # what lightning does to torch.compile on its import (litgpt)
    return _compile(*args, **kwargs)


torch.compile = compile


class StandIn(FusedQKVMHA):
    pass
"""


def test_a_library_that_replaces_torch_compile_on_import_is_checked_at_every_mask_and_mode(
    tmp_path,
):
    """Issue 73's stand-in for litgpt where it is not installed: every point ``ok`` under
    ``check_only`` (it was ``unsupported`` at each, and its worker replaced each time), the
    rows naming torch.compile, and the plain way beside it unchanged."""
    (tmp_path / "stand_in.py").write_text(STAND_IN)
    (tmp_path / "variant").mkdir()
    (tmp_path / "variant" / "stand_in.yaml").write_text(
        "_target_: stand_in.StandIn\nattention: sdpa\nmerge: view\n"
    )
    out = tmp_path / "sweep"
    proc = run_harness(
        "-m", "--config-dir", str(tmp_path), "variant=stand_in,fused", "seq_len=16",
        "mask=none,causal", "mode=fwd,fwd_bwd", "check_only=true", f"hydra.sweep.dir={out}",
        f"report_dir={tmp_path / 'reports'}", cwd=tmp_path, paths=(tmp_path,),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = pd.read_csv(out / "results.csv")
    assert (rows["status"] == "ok").all(), rows[["variant", "status", "error"]]
    mine = rows[rows["variant"] == "stand_in"]
    assert len(mine) == 4 and (mine["torch_changed"] == "torch.compile").all(), mine
    assert rows[rows["variant"] == "fused"]["torch_changed"].isna().all()


GLOBAL_STATE = """
import threading
import time

import torch
from variants.fused import FusedQKVMHA


class Setter(FusedQKVMHA):  # flips torch's global switches as it is built (issue 74)
    def __init__(self, *args, **kwargs):
        torch.set_float32_matmul_precision("medium")
        torch.autograd.set_detect_anomaly(True)
        super().__init__(*args, **kwargs)


class Probe(FusedQKVMHA):  # fails where another point's switches reached it
    def __init__(self, *args, **kwargs):
        if torch.is_anomaly_enabled() or torch.get_float32_matmul_precision() != "highest":
            raise RuntimeError("another point's global torch state reached this one")
        super().__init__(*args, **kwargs)


def _idle():
    while True:
        time.sleep(0.05)


class Threaded(FusedQKVMHA):  # leaves a thread running beside every later call
    def __init__(self, *args, **kwargs):
        threading.Thread(target=_idle, name="left-behind", daemon=True).start()
        super().__init__(*args, **kwargs)
"""


def test_a_variants_global_torch_state_is_its_own_and_a_thread_it_leaves_is_named(tmp_path):
    """Issue 74: matmul precision and anomaly mode set by one variant applied to every later
    point of its worker, unsaid; a thread it started timed them. Now the switches are its
    world (in place for its own calls only, said in its rows) and a thread is named, the
    point not timed and the worker replaced."""
    (tmp_path / "global_state.py").write_text(GLOBAL_STATE)
    (tmp_path / "variant").mkdir()
    for name in ("Setter", "Probe", "Threaded"):
        (tmp_path / "variant" / f"{name.lower()}.yaml").write_text(
            f"_target_: global_state.{name}\nattention: sdpa\nmerge: view\n"
        )
    out = tmp_path / "sweep"
    proc = run_harness(
        "-m", "--config-dir", str(tmp_path), "variant=setter,probe,threaded,reference",
        "seq_len=16,32", "timing.rounds=3", "timing.round_time=0.01",
        f"hydra.sweep.dir={out}", f"report_dir={tmp_path / 'reports'}",
        cwd=tmp_path, paths=(tmp_path,),
    )  # fmt: skip
    rows = pd.read_csv(out / "results.csv")
    by = {v: g for v, g in rows.groupby("variant")}
    assert (by["probe"]["status"] == "ok").all(), by["probe"][["status", "error"]]
    assert (by["reference"]["status"] == "ok").all(), by["reference"][["status", "error"]]
    setter = by["setter"]
    assert (setter["status"] == "ok").all(), setter[["status", "error"]]
    assert setter["latency_ms_median"].notna().all()
    said = setter["torch_changed"].iloc[0]
    assert "torch.float32_matmul_precision=medium" in said, said
    assert "torch.autograd.anomaly_mode=True" in said, said
    threaded = by["threaded"]
    assert (threaded["status"] == "unsupported").all(), threaded[["status", "error"]]
    assert "a thread it started (left-behind)" in threaded["error"].iloc[0]
    assert threaded["latency_ms_median"].isna().all()
    assert proc.returncode in (0, 1), proc.stderr[-2000:]


SPAWNING = """
import os
import subprocess
import sys
from pathlib import Path

from variants.fused import FusedQKVMHA

SLEEP = [sys.executable, "-c", "import time; time.sleep(600)"]


class Spawner(FusedQKVMHA):  # leaves a process running, out of the worker's group (issue 74)
    def __init__(self, *args, **kwargs):
        child = subprocess.Popen(SLEEP, start_new_session=True)
        Path(os.environ["PIDS"], f"{child.pid}").touch()
        super().__init__(*args, **kwargs)


class Daemon(FusedQKVMHA):  # forks twice: the sleeper's parent is gone, it is nobody's child
    def __init__(self, *args, **kwargs):
        code = (
            "import os, subprocess, sys; "
            f"p = subprocess.Popen({SLEEP!r}, start_new_session=True); "
            "open(os.path.join(os.environ['PIDS'], str(p.pid)), 'w').close()"
        )
        subprocess.run([sys.executable, "-c", code], check=True)
        super().__init__(*args, **kwargs)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs Linux's /proc")
# three sweeps (20 s here; test_operator.py ends a variant's process with the sweep): make
# test-slow and CI run it
@pytest.mark.slow
def test_a_process_a_variant_leaves_is_named_and_ended_with_the_sweep(tmp_path):
    """Issue 74: a child that called setsid left the worker's process group and outlived the
    sweep. Now a process a variant starts, directly or through a daemon's double fork, is named
    in its row (not timed, the worker replaced), and ended when its worker is."""
    (tmp_path / "spawning.py").write_text(SPAWNING)
    (tmp_path / "variant").mkdir()
    for name in ("Spawner", "Daemon"):
        (tmp_path / "variant" / f"{name.lower()}.yaml").write_text(
            f"_target_: spawning.{name}\nattention: sdpa\nmerge: view\n"
        )
    pids = tmp_path / "pids"
    pids.mkdir()
    out = tmp_path / "sweep"
    proc = run_harness(
        "-m", "--config-dir", str(tmp_path), "variant=spawner,daemon,reference",
        "seq_len=16", "timing.rounds=3", "timing.round_time=0.01",
        f"hydra.sweep.dir={out}", f"report_dir={tmp_path / 'reports'}",
        cwd=tmp_path, paths=(tmp_path,), env={"PIDS": str(pids)},
    )  # fmt: skip
    started = [int(p.name) for p in pids.iterdir()]
    try:
        rows = pd.read_csv(out / "results.csv")
        by = {v: g.iloc[0] for v, g in rows.groupby("variant")}
        for name in ("spawner", "daemon"):
            assert by[name]["status"] == "unsupported", by[name][["status", "error"]]
            assert "a process it started" in by[name]["error"], by[name]["error"]
        assert by["reference"]["status"] == "ok", by["reference"]["error"]
        assert len(started) >= 2
        assert [p for p in started if _alive(p)] == [], proc.stderr[-2000:]
    finally:
        for pid in started:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs Linux's /proc")
def test_a_compile_pools_workers_are_torchs_not_the_variants(tmp_path, monkeypatch):
    """Inductor's compile pool (torch/_inductor/compile_worker) starts its workers by spawn,
    whose command line names no torch: they are torch's by their ancestor, a variant's own child
    is found."""
    from harness import processes

    pool_dir = tmp_path / "torch" / "_inductor"
    pool_dir.mkdir(parents=True)
    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    (pool_dir / "pool.py").write_text(
        f"import subprocess, time\nsubprocess.Popen({sleep!r})\ntime.sleep(60)\n"
    )
    monkeypatch.setenv(processes.MARK, f"test-{os.getpid()}")
    subprocess.Popen([sys.executable, str(pool_dir / "pool.py")])  # its worker: a grandchild
    mine = subprocess.Popen(sleep)
    try:
        deadline = time.monotonic() + 20
        while len(processes.marked(os.environ[processes.MARK])) < 3:
            assert time.monotonic() < deadline, "the pool's worker did not start"
            time.sleep(0.1)
        assert processes.started() == {mine.pid}
    finally:
        for pid in processes.marked(os.environ[processes.MARK]):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
