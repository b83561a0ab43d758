"""A CUDA graph capture that fails leaves a working worker (issue 56), against a capture modelled
on torch 2.11's (tests/fakecapture.py): the call's own error is reported, the stream it ran on is
restored, the next point captures; a capture that cannot be ended replaces the worker before
anything synchronizes (which would abort the process); the graph's pool is counted in what the
point holds."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from fakecapture import INVALIDATED, REFUSED, FakeCuda
from harness.errors import BrokenDevice
from harness.factory import make_point
from harness.measure import session as session_mod
from harness.measure import timing

OUT = torch.ones(2, 3)


@pytest.fixture
def fake(monkeypatch):
    made = {}

    def install(**kwargs) -> FakeCuda:
        made["fake"] = FakeCuda(**kwargs)
        made["fake"].install(monkeypatch, torch)
        return made["fake"]

    return install


def synchronizing():
    """A call that synchronizes (``torch.all(mask)`` on the device, ``.item()``): fine eagerly,
    refused inside a capture."""
    torch.cuda.synchronize()
    return OUT, None


def test_a_call_that_fails_inside_the_capture_raises_its_own_error_and_the_next_one_captures(fake):
    cuda = fake()
    with pytest.raises(RuntimeError) as failed:
        timing.cuda_graph(synchronizing)
    assert REFUSED in str(failed.value) and INVALIDATED not in str(failed.value)
    assert cuda.current is cuda.default and cuda.capturing is None  # the stream restored
    replay = timing.cuda_graph(lambda: (OUT, None))  # the next point, in the same process
    assert replay() == (OUT, None) and cuda.captures == 1


def cuda_session(call) -> session_mod.Session:
    point = make_point("fused", device="cpu")
    point = dataclasses.replace(point, device="cuda")
    return session_mod.Session(point, call, None, 0, finish=None)


def test_a_capture_left_open_replaces_the_worker_before_anything_synchronizes(fake):
    fake(stuck=True)
    s = cuda_session(synchronizing)
    with pytest.raises(BrokenDevice, match="could not be ended"):
        s.capture()  # a synchronize after it would raise fakecapture.Aborted


def test_the_graphs_pool_is_counted_in_what_the_point_holds(fake, monkeypatch):
    cuda = fake(pool_mb=300)
    monkeypatch.setattr(session_mod, "sampler", lambda fn, device, flush: types.SimpleNamespace())
    s = cuda_session(lambda: (OUT, None))
    s.capture()
    assert s.timed_by == "graph" and cuda.captures == 1
    assert s.nbytes == 300 * 2**20  # the cache is not emptied first: the pool reads as itself


def test_a_new_shape_that_would_pass_the_budget_times_the_waiting_points_before_it_is_prepared(
    monkeypatch,
):
    """The memory budget is kept before a point's graph is captured, not after (issue 56): a
    point at a new shape whose expected bytes, with the waiting points', pass the budget has the
    waiting points timed first; the same shape, or room enough, waits on."""
    from harness.measure import rounds

    ran = []
    monkeypatch.setattr(rounds, "run_rounds", lambda sessions, *a: ran.append(len(sessions)))
    pool = rounds.Pool(say=lambda line: None)
    small = make_point("fused", seq_len=16, embed_dim=64, timing={"resident_mb": 1})
    waiting = types.SimpleNamespace(key=small.shape_key(), nbytes=2**19)  # 0.5 MiB
    pool.sessions, pool.held = [waiting], waiting.nbytes
    pool.make_room(small)  # its own shape: the block goes on
    assert ran == [] and rounds.expected_bytes(small) + pool.held < 2**20
    pool.make_room(make_point("fused", seq_len=17, embed_dim=64, timing={"resident_mb": 1}))  # room
    assert ran == []
    big = make_point("fused", seq_len=2048, embed_dim=64, timing={"resident_mb": 1})
    assert rounds.expected_bytes(big) + pool.held > 2**20
    pool.make_room(big)
    assert ran == [1] and pool.sessions == [] and pool.held == 0
    graphed = dataclasses.replace(big, device="cuda")  # its graph's pool: the call's tensors again
    assert rounds.expected_bytes(graphed) == 2 * rounds.expected_bytes(big)
    # a point whose variant cannot be imported is not refused here: its own check says why
    bad = dataclasses.replace(big, variant=dataclasses.replace(big.variant, target="no.such.Mod"))
    assert rounds.expected_bytes(bad) == rounds.expected_bytes(big)
