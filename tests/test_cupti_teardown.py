"""After a CUDA profile no CUPTI tracing is left attached to the calls timed later (PyTorch
issue 144455: 10-20% slower): the probe and the profiling pass ask Kineto to tear CUPTI down."""

from __future__ import annotations

import pytest
import torch

from harness.measure import probe as probe_mod


@pytest.fixture
def env(monkeypatch):
    monkeypatch.delenv("TEARDOWN_CUPTI", raising=False)
    return monkeypatch


@pytest.mark.parametrize(
    "cuda_version, device, asked",
    [
        ("13.0", "cuda", True),
        ("12.6", "cuda:1", True),
        ("12.4", "cuda", False),
        ("13.0", "cpu", False),
    ],
)
def test_teardown_is_asked_for_cuda_profiles_where_graphs_survive_it(
    env, cuda_version, device, asked
):
    import os

    env.setattr(torch.version, "cuda", cuda_version)
    assert probe_mod.cupti_teardown(device) is asked
    assert os.environ.get("TEARDOWN_CUPTI") == ("1" if asked else None)


def test_a_users_own_setting_stands(env):
    import os

    env.setattr(torch.version, "cuda", "13.0")
    env.setenv("TEARDOWN_CUPTI", "0")
    assert probe_mod.cupti_teardown("cuda") is False and os.environ["TEARDOWN_CUPTI"] == "0"


def test_the_probe_and_the_profile_ask_before_profiling(env, tmp_path):
    from harness.config import ProfilerOptions
    from harness.measure import profiling

    asked = []
    env.setattr(probe_mod, "cupti_teardown", lambda device: asked.append(device))
    env.setattr(profiling, "cupti_teardown", lambda device: asked.append(device))
    x = torch.randn(8, 8)
    probe_mod.probe(lambda: x @ x, "cpu", (1, 1, 8, 8, 8), 4)
    profiling.run_profile(lambda: x @ x, None, "cpu", tmp_path, "w", ProfilerOptions())
    assert asked == ["cpu", "cpu"]
