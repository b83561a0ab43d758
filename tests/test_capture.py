"""CUDA graph captures (issue 56), against a capture modelled on torch 2.11's
(tests/fakecapture.py): a call that fails inside the capture reports its own error, the stream
it ran on is restored and the next point captures; a capture that cannot be ended replaces the
worker before anything synchronizes (which would abort the process); the graph's pool is
counted in what the point holds, and many graphs' pools add up; a fwd_bwd call and a decode
step are captured after their ``before`` (gradients cleared, the cache rewound), so the graph
computes the checked call."""

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
        monkeypatch.setattr(timing.GraphMemory, "streams", {})  # the process's: this fake's
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


def test_a_failed_capture_does_not_leave_the_allocator_capturing(fake):
    """torch < 2.12 (pytorch#180395): a capture_end that raises skips the allocator's
    endAllocateToPool, and every later allocation of the worker fails as out of memory (false
    ``oom`` rows). The failed capture's end ends it; the next point's eager call allocates."""
    cuda = fake(leaky=True)
    with pytest.raises(RuntimeError, match="not permitted"):
        timing.cuda_graph(synchronizing)
    assert cuda.routing == set()
    assert cuda.call()[0].shape == (2, 3)  # no false out-of-memory
    assert timing.cuda_graph(cuda.call)()[0].shape == (2, 3)  # and the next capture works


def cuda_session(call, resident_mb=None, seq_len=8) -> session_mod.Session:
    point = make_point("fused", device="cpu", seq_len=seq_len, timing={"resident_mb": resident_mb})
    point = dataclasses.replace(point, device="cuda")
    return session_mod.Session(point, call, None, 0, finish=None)


def test_a_capture_left_open_replaces_the_worker_before_anything_synchronizes(fake):
    fake(stuck=True)
    s = cuda_session(synchronizing)
    with pytest.raises(BrokenDevice, match="could not be ended"):
        s.capture()  # a synchronize after it would raise fakecapture.Aborted


def test_a_capture_left_open_in_the_pool_is_that_points_error_not_a_retry(fake):
    """The pool captures a point when it takes it: a capture left open raises BrokenDevice (the
    worker is replaced) with the point's own failure on it, so that its row says so and it is
    not prepared again in the next worker (where it would break that one too)."""
    from harness.measure import rounds

    fake(stuck=True)
    pool = rounds.Pool(say=lambda line: None)
    s = cuda_session(synchronizing)
    with pytest.raises(BrokenDevice):
        pool.add(s)
    assert s.failure[0] == "error" and "could not be ended" in s.failure[1]
    assert "its CUDA graph capture" in s.failure[1] and pool.sessions == []


def test_a_block_with_a_failed_capture_replaces_its_worker_after_its_rounds(fake, monkeypatch):
    """A capture that failed into the block's shared pool raises the pool's use count for good
    on a torch without pytorch#190348 (it is never freed): the point is timed with events, the
    block's rounds run, and then the pool asks for a fresh worker, saying why."""
    from harness.measure import rounds

    fake(leaky=True)
    monkeypatch.setattr(session_mod, "sampler", lambda fn, device, flush: types.SimpleNamespace())
    monkeypatch.setattr(rounds, "run_rounds", lambda sessions, *a: None)
    pool = rounds.Pool(say=lambda line: None)
    s = cuda_session(synchronizing)
    pool.add(s)
    assert s.timed_by != "graph" and "not captured in a CUDA graph" in s.graph_error
    assert pool.replace is None  # its block is still to be timed here
    pool.run()
    assert "a CUDA graph capture failed in this worker" in pool.replace


def test_the_graphs_pool_is_counted_in_what_the_point_holds_and_nothing_else(fake, monkeypatch):
    """What a captured point holds is its graph's pool: not the blocks its warm-up left cached
    on the capture stream (an H200 read nn.MHA's pool at 2x its call's peak that way: 38 GB at
    L=4096), which are returned before the capture, as torch.cuda.graph does."""
    cuda = fake(pool_mb=300)
    monkeypatch.setattr(session_mod, "sampler", lambda fn, device, flush: types.SimpleNamespace())
    s = cuda_session(cuda.call)
    s.capture()
    assert s.timed_by == "graph" and cuda.captures == 1
    assert s.nbytes == 300 * 2**20
    assert cuda.reserved_mb == 300  # the warm-up's cache returned, the pool kept


def test_a_blocks_graphs_share_one_pool_and_one_stream(fake, monkeypatch):
    """The graphs of the points that wait together (a Pool's block) share one memory pool and
    one capture stream: the block holds about its largest call plus every graph's outputs, not
    the sum of the calls (at B=8, L=4096, causal, a shape's twenty graphs would not fit an
    H100). Each point holds what its capture added; a new block gets a new pool."""
    from harness.measure import rounds

    cuda = fake(pool_mb=300, out_mb=10)
    monkeypatch.setattr(session_mod, "sampler", lambda fn, device, flush: types.SimpleNamespace())
    monkeypatch.setattr(rounds, "run_rounds", lambda sessions, *a: None)
    pool = rounds.Pool(say=lambda line: None)
    sessions = [cuda_session(cuda.call) for _ in range(3)]
    for s in sessions:
        pool.add(s)
    assert [s.timed_by for s in sessions] == ["graph"] * 3
    assert [s.nbytes // 2**20 for s in sessions] == [310, 10, 10]
    assert cuda.reserved_mb == 330 and len(cuda.pools) == 1  # not 3 x 310
    (first,) = cuda.pools
    pool.run()
    pool.add(cuda_session(cuda.call))
    assert len(cuda.pools) == 1 and first not in cuda.pools  # the next block's own


def test_a_blocks_pool_is_freed_when_its_rounds_end_though_its_sessions_are_kept(
    fake, monkeypatch
):
    """A block's graphs share one pool, freed only when its last graph dies (issue 71, D1): the
    rounds' end lets go of every session's call and graph, so the worker that keeps its last
    session until the next point is prepared does not keep the pool reserved through that point's
    check and warm-up; the modules a call held go too."""
    import gc
    import weakref

    from harness.measure import rounds

    cuda = fake(pool_mb=300, out_mb=10)
    monkeypatch.setattr(session_mod, "sampler", lambda fn, device, flush: types.SimpleNamespace())
    monkeypatch.setattr(rounds, "run_rounds", lambda sessions, *a: None)

    class Model(torch.nn.Module):
        def forward(self):
            return cuda.call()

    models = [Model() for _ in range(3)]
    alive = [weakref.ref(m) for m in models]
    pool = rounds.Pool(say=lambda line: None)
    kept = [cuda_session(m) for m in models]  # as the worker's loop keeps its last one
    del models
    for s in kept:
        pool.add(s)
    assert len(cuda.pools) == 1 and cuda.reserved_mb == 330
    pool.run()
    gc.collect()
    assert cuda.pools == {} and cuda.reserved_mb == 0, cuda.pools
    assert [r() for r in alive] == [None, None, None]  # no call keeps its module alive


def test_the_budget_is_kept_with_the_graph_measured_before_its_capture(fake, monkeypatch):
    """A point at a new shape whose graph would take the waiting points past the budget has
    them timed first, before its capture; its graph's bytes are its warm call's peak (measured
    in the warm-up), not a model of the variant (nn.MHA's footprint said 784 MB where its graph
    held 38 GB)."""
    from harness.measure import rounds

    cuda = fake(pool_mb=300)
    monkeypatch.setattr(session_mod, "sampler", lambda fn, device, flush: types.SimpleNamespace())
    ran = []
    monkeypatch.setattr(rounds, "run_rounds", lambda sessions, *a: ran.append(len(sessions)))
    pool = rounds.Pool(say=lambda line: None)
    first = cuda_session(cuda.call, resident_mb=500)
    first.call_bytes = 300 * 2**20
    assert first.graph_bytes() > 300 * 2**20  # with room for the allocator's rounding
    pool.add(first)
    assert first.graph_bytes() == 0  # captured: nothing more to come
    same = cuda_session(cuda.call, resident_mb=500)
    same.call_bytes = 300 * 2**20
    pool.add(same)  # its own shape waits with it, whatever it holds
    assert ran == []
    other = cuda_session(cuda.call, resident_mb=500, seq_len=9)
    other.call_bytes = 300 * 2**20
    captures = cuda.captures
    pool.add(other)
    assert ran == [2] and cuda.captures == captures + 1 and pool.sessions == [other]
    small = cuda_session(cuda.call, resident_mb=500, seq_len=10)
    small.call_bytes = 2**20
    pool.add(small)  # room enough: the block goes on
    assert ran == [2] and len(pool.sessions) == 2


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
    waiting = types.SimpleNamespace(  # 0.5 MiB
        key=small.shape_key(), nbytes=2**19, point=small, release=lambda: None
    )
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
    # nn.MHA itself holds the float (B*H, L, S) mask it is handed for ALiBi in its call
    ref = make_point("reference", seq_len=256, embed_dim=64, num_heads=4)
    alibi = dataclasses.replace(ref, position_bias="alibi")
    assert rounds.expected_bytes(alibi) - rounds.expected_bytes(ref) == 4 * 2 * 4 * 256 * 256


def test_a_fwd_bwd_call_is_captured_after_its_gradients_are_cleared(fake):
    """fwd_bwd: the capture runs the point's ``before`` (clearing the gradients) before each
    warm-up call and before the captured one, so the graph's gradients are one call's, not the
    sum of four (the warm-ups' and the capture's)."""
    from harness.point import timing_setup

    fake()
    point = make_point("fused", seq_len=8, embed_dim=32, num_heads=2, mode="fwd_bwd")
    call, before = timing_setup(point)
    before()
    call()
    model = next(  # the module the timed call runs (its closure's)
        c.cell_contents for c in call.__closure__ if isinstance(c.cell_contents, torch.nn.Module)
    )
    once = {n: p.grad.clone() for n, p in model.named_parameters()}
    replay = timing.cuda_graph(call, before)
    out, _ = replay()
    assert out.shape == (point.batch, 8, 32)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, once[name])  # one call's, not four


def test_a_decode_step_is_captured_on_a_rewound_cache(fake):
    """A decode point whose cache keeps what each call appends (as transformers' DynamicCache
    does, under the rewind contract): the rewind runs before each warm-up call and before the
    capture, so the captured call reads the prefix's cache, as the checked call did; without it
    the cache held three more copies of the step and the graph computed another output. The
    harness's own decode point captures its checked output."""
    from harness.point import timing_setup

    fake()
    cache: list = []

    def step():  # attends over what the cache holds: its output is the cache's length
        cache.append(1)
        return torch.tensor([float(len(cache))]), None

    replay = timing.cuda_graph(step, cache.clear)
    assert replay()[0].item() == 1.0  # the prefix and this step: what the check saw
    cache.clear()
    assert timing.cuda_graph(step)()[0].item() == 4.0  # three warm-ups kept: another output

    point = make_point("fused", seq_len=2, kv_cache_len=6, embed_dim=32, num_heads=2)
    call, before = timing_setup(point)
    checked = call()[0].clone()
    torch.testing.assert_close(timing.cuda_graph(call, before)()[0], checked)


def test_many_graphs_hold_a_pool_each_and_a_failed_capture_between_them_costs_nothing(
    fake, monkeypatch
):
    """Three points captured in one worker, each in a pool of its own, the second failing
    inside its capture: each captured one holds its own pool (they add up in the allocator), the
    failed one keeps its event timing and its own error, and the third captures after it."""
    cuda = fake(pool_mb=300)
    monkeypatch.setattr(session_mod, "sampler", lambda fn, device, flush: types.SimpleNamespace())
    sessions = [cuda_session(c) for c in (cuda.call, synchronizing, cuda.call)]
    for s in sessions:
        s.capture()
    first, failed, third = sessions
    assert first.timed_by == third.timed_by == "graph" and failed.timed_by == "wall"
    assert REFUSED in failed.graph_error and INVALIDATED not in failed.graph_error
    assert first.nbytes == third.nbytes == 300 * 2**20 and failed.nbytes == 0
    assert sorted(cuda.pools.values()) == [300, 300] and cuda.captures == 2
    assert cuda.current is cuda.default and cuda.capturing is None


def test_a_cuda_errors_advice_is_left_out_of_its_one_line():
    """torch appends the same advice to every CUDA error; the H200 probe's graph_error was 480
    characters, 60 of them the error. The one line is the error; a sticky error still reads as
    sticky."""
    from harness.errors import is_sticky, one_line

    advice = (
        "\nSearch for `cudaErrorStreamCaptureUnsupported' in https://docs.nvidia.com/cuda/"
        "cuda-runtime-api/group__CUDART__TYPES.html for more information.\nCUDA kernel errors "
        "might be asynchronously reported at some other API call, so the stacktrace below might "
        "be incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1\nCompile with "
        "`TORCH_USE_CUDA_DSA` to enable device-side assertions.\n"
    )
    assert one_line(RuntimeError(REFUSED + advice)) == f"RuntimeError: {REFUSED}"
    sticky = one_line(RuntimeError("CUDA error: an illegal memory access was encountered" + advice))
    assert is_sticky(sticky) and "CUDA_LAUNCH_BLOCKING" not in sticky


def test_blocks_share_the_processs_capture_stream(fake, monkeypatch):
    """Each block has its own pool but not its own stream (issue 71, D10): a new stream per block
    got a cuBLAS workspace of its own, block after block, that no block's count held."""
    from harness.measure import rounds

    fake()
    monkeypatch.setattr(rounds, "run_rounds", lambda sessions, *a: None)
    pool = rounds.Pool(say=lambda line: None)
    first = pool.memory
    pool.run()
    assert pool.memory is not first and pool.memory.pool("cuda") != first.pool("cuda")
    assert pool.memory.stream("cuda") is first.stream("cuda")


def test_a_blocks_budget_counts_the_nn_mha_its_rounds_will_build_to_pair_with(monkeypatch):
    """Issue 71, D10: where no point of a shape is nn.MultiheadAttention (sweep=toggles), the
    rounds build one to pair with, captured in a pool of its own, which no block counted. The
    budget now counts it from the shape's first point, and not once the shape's own waits."""
    from harness.measure import rounds

    ran = []
    monkeypatch.setattr(rounds, "run_rounds", lambda sessions, *a: ran.append(len(sessions)))

    def waiting(point, reference=False):
        return types.SimpleNamespace(
            key=point.shape_key(), nbytes=2**17, point=point, reference=reference,
            capture=lambda memory: None, graph_bytes=lambda: 0, release=lambda: None,
        )  # fmt: skip

    budget = {"resident_mb": 0.4}
    a = make_point("fused", seq_len=16, embed_dim=64, timing=budget)
    b = make_point("fused", seq_len=17, embed_dim=64, timing=budget)
    pool = rounds.Pool(say=lambda line: None)
    pool.add(waiting(a))
    assert pool.pairing == {a.shape_key(): rounds.pairing_bytes(a)} and rounds.pairing_bytes(a) > 0
    # the points alone would fit; with the two nn.MHA built to pair them they would not
    assert pool.held + rounds.expected_bytes(b) < 0.4 * 2**20
    assert pool._holding() + rounds.expected_bytes(b) + rounds.pairing_bytes(b) > 0.4 * 2**20
    pool.make_room(b)
    assert ran == [1] and pool.sessions == [] and pool.pairing == {}
    # the shape's own nn.MHA waiting among its points: none is built, none counted
    nn_mha = make_point("reference", seq_len=16, embed_dim=64, timing=budget)
    pool.add(waiting(nn_mha, reference=True))
    pool.add(waiting(a))
    assert pool.pairing == {a.shape_key(): 0} and pool._holding() == pool.held
