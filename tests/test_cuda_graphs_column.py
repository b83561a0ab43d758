"""A row with compile=reduce-overhead says whether its timed call replays CUDA graphs: inductor
skips them for an input mutated in place (a KV cache written at decode) and says so only in a
log line."""

from __future__ import annotations

import dataclasses

import pytest

import harness.way.build
import harness.way.calls
import harness.point as point_mod
import harness.way.check as check_mod
from harness.way.compiling import replays_graphs
from harness.factory import make_point


def point(compile="reduce-overhead", device="cpu"):
    p = make_point("fused", batch=1, seq_len=8, embed_dim=16, num_heads=2, device="cpu")
    return dataclasses.replace(p, compile=compile, device=device)


@pytest.mark.parametrize(
    "compile, device, skipped, graphs",
    [
        ("off", "cuda", 0, None),
        ("default", "cuda", 0, None),
        ("reduce-overhead", "cuda", 0, True),
        ("reduce-overhead", "cuda:1", 1, False),  # skipped: the row must not claim graphs
        ("max-autotune", "cuda", 2, False),
        ("reduce-overhead", "cpu", 0, False),  # no CUDA graphs on a CPU
    ],
)
def test_what_the_row_says(compile, device, skipped, graphs):
    assert replays_graphs(point(compile, device), skipped) is graphs


@pytest.mark.parametrize("when", ["check", "warm-up", "never"])
def test_a_skip_at_the_first_call_or_at_warm_up_reaches_the_row(monkeypatch, when):
    """Inductor skipping graphs (its cudagraph_skips counter bumped) while the point compiles at
    its check, or at a warm-up call, makes the row's cuda_graphs false. (Faked here: no compile
    and a CUDA device cannot run on this machine; the wiring is what is tested.)"""
    skips = {"n": 0}
    monkeypatch.setattr(harness.way.build, "maybe_compile", lambda model, mode: model)
    for module in (point_mod, check_mod):  # the check's call, and the warm-up's
        monkeypatch.setattr(module, "cudagraph_skips", lambda: skips["n"])
    monkeypatch.setattr(check_mod, "replays_graphs", lambda p, skipped: skipped == 0)
    real_collect, real_prepare = harness.way.calls.collect, point_mod.Session.prepare

    def collect(*args, **kwargs):
        skips["n"] += when == "check"
        return real_collect(*args, **kwargs)

    def prepare(self):
        skips["n"] += when == "warm-up"
        return real_prepare(self)

    monkeypatch.setattr(harness.way.calls, "collect", collect)
    monkeypatch.setattr(point_mod.Session, "prepare", prepare)
    p = dataclasses.replace(
        point(),
        timing=dataclasses.replace(point().timing, warmup=0.001, rounds=2, round_time=0.002),
    )
    row = point_mod.run_point(p)
    assert row["status"] == "ok" and row["cuda_graphs"] is (when == "never")
