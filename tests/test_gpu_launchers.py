"""Launchers on GPU machines: SLURM's GPU request decides
the shapes of device=auto, submitit_local's jobs get the GPUs the sweep was given, and joblib's
one-job-per-GPU sweeps run no more jobs at once than there are GPUs. Fakes stand in for the
launchers and the GPUs."""

from __future__ import annotations

import pytest
import torch

from harness.envinfo import PARENT_GPUS, inherit_gpus
from hydra_plugins.mha_bench import sweeper
from hydra_plugins.mha_bench.sweeper import jobs_on_gpus, on_cuda, slurm_gpus


def launcher(kind: str, **params):
    cls = type(kind, (), {})  # named like hydra-submitit-launcher's / hydra-joblib-launcher's
    obj = cls()
    obj.params = dict(params)
    if kind == "JoblibLauncher":
        obj.joblib = dict(n_jobs=params.get("n_jobs", -1))
    return obj


@pytest.mark.parametrize(
    "params, gpus",
    [
        (dict(gpus_per_node=1), 1),
        (dict(gpus_per_task=2), 2),
        (dict(gres="gpu:a100:4"), 4),
        (dict(gres="gpu:2"), 2),
        (dict(gres="gpu"), 1),
        (dict(cpus_per_task=8), 0),
    ],
)
def test_what_a_slurm_job_asks(params, gpus):
    assert slurm_gpus(launcher("SlurmLauncher", **params)) == gpus
    assert slurm_gpus(launcher("LocalLauncher", **params)) is None  # its jobs run here


def test_slurm_from_a_gpu_less_login_node_sweeps_gpu_shapes(monkeypatch):
    """device=auto on a login node without a GPU: the jobs' nodes have the GPUs SLURM is asked
    for, so the preset's cuda_params apply; asked for none, a GPU login node's own GPUs do not
    make the shapes GPU-sized."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert on_cuda("auto", [], launcher("SlurmLauncher", gpus_per_node=1)) is True
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert on_cuda("auto", [], launcher("SlurmLauncher", cpus_per_task=8)) is False
    assert on_cuda("auto", ["device=cpu"], launcher("SlurmLauncher", gpus_per_node=1)) is False
    assert on_cuda("auto", []) is True  # the basic launcher: this machine's GPUs


def test_joblib_one_job_per_gpu_runs_as_many_at_once_as_there_are_gpus():
    at_once, note = jobs_on_gpus(launcher("JoblibLauncher", n_jobs=-1), gpu_count=2, spread=True)
    assert at_once == 2 and "one per GPU" in note
    at_once, note = jobs_on_gpus(launcher("JoblibLauncher", n_jobs=-1), 2, spread=False)
    assert at_once is None and note.startswith("warning")


def test_submitit_local_jobs_get_the_gpus_the_sweep_was_given(monkeypatch):
    """submitit hands job GPUs '0,1', indices into the sweep's CUDA_VISIBLE_DEVICES=2,3, which
    CUDA would read as the machine's first two: the job maps them back before CUDA starts."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    monkeypatch.delenv(PARENT_GPUS, raising=False)
    jobs_on_gpus(launcher("LocalLauncher"), gpu_count=2, spread=True)
    import os

    assert os.environ[PARENT_GPUS] == "2,3"
    job = {PARENT_GPUS: "2,3", "CUDA_VISIBLE_DEVICES": "0,1", "SUBMITIT_EXECUTOR": "local"}
    assert inherit_gpus(job) == "2,3" and job["CUDA_VISIBLE_DEVICES"] == "2,3"
    one = {PARENT_GPUS: "2,3", "CUDA_VISIBLE_DEVICES": "1", "SUBMITIT_EXECUTOR": "local"}
    assert inherit_gpus(one) == "3"
    # not a submitit_local job, or no list given to the sweep: left alone
    assert inherit_gpus({"CUDA_VISIBLE_DEVICES": "0", "SUBMITIT_EXECUTOR": "local"}) is None
    assert inherit_gpus({PARENT_GPUS: "2,3", "CUDA_VISIBLE_DEVICES": "0"}) is None


def test_the_sweeper_says_which_shapes_slurm_chose(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    s = sweeper.HarnessSweeper(params={"seq_len": "128"}, cuda_params={"seq_len": "4096"})
    s.launcher = launcher("SlurmLauncher", gpus_per_node=1)
    s.config = {"device": "auto"}

    class Stop(Exception):
        pass

    def stop(*args, **kwargs):
        raise Stop

    monkeypatch.setattr(sweeper.BasicSweeper, "sweep", stop)
    with pytest.raises(Stop):
        s.sweep([])
    assert s.params == {"seq_len": "4096"}
    assert "GPU-sized cuda_params" in capsys.readouterr().out
