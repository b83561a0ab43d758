"""pytest-benchmark suite: every registered variant x a few shapes, grouped by shape.

    make bench                 # run, save (.benchmarks/), compare with the last saved run
    python -m pytest benchmarks --benchmark-enable --benchmark-compare=0001

The suite times the harness's own callable for each point (harness.point.timing_setup), so
pytest-benchmark's numbers and the harness's measure the same call. On CUDA each round ends
with a synchronize. Benchmarks are disabled by default (pyproject addopts): `make test` and CI
run each case once as a test.
"""

import pytest
import torch
from harness.point import timing_setup
from harness.factory import make_point
from tests.conftest import WAYS

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [  # (batch, seq_len, embed_dim, num_heads)
    (2, 128, 256, 4),
    (2, 512, 256, 4),
    (1, 1024, 512, 8),
]
MODES = ["fwd", "fwd_bwd"]


def bench_point(name, shape, mode):
    B, L, E, H = shape
    return make_point(
        name,
        batch=B,
        seq_len=L,
        embed_dim=E,
        num_heads=H,
        dtype="float32",
        device=DEVICE,
        mode=mode,
    )


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}-L{}-E{}-H{}".format(*s))
@pytest.mark.parametrize("name", WAYS)  # plain MHA's ways
def test_mha(benchmark, name, shape, mode):
    point = bench_point(name, shape, mode)
    call, before = timing_setup(point)
    sync = torch.cuda.synchronize if DEVICE == "cuda" else (lambda: None)

    def run():
        call()
        sync()

    benchmark.group = "B{}-L{}-E{}-H{} {}".format(*shape, mode)
    benchmark.extra_info.update(variant=point.variant.label, device=DEVICE, dtype=point.dtype)
    if before is None:
        benchmark(run)
    else:  # fwd_bwd: clear gradients before each round, outside the timed region
        benchmark.pedantic(run, setup=before, rounds=20, warmup_rounds=2)
