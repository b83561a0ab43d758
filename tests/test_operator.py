"""What an operator does to a run, answered in one line with nothing lost (issue 58): here, a
reader that goes away (``mha-bench run -m ... | head -2``)."""

import subprocess
import sys

import pytest
import pandas as pd

from variants.fused import FusedQKVMHA

from tests.conftest import TINY, harness_env


@pytest.mark.slow  # 17 s; the gallery's pipe cases are in make test-slow too (tests/operator/)
def test_a_sweep_whose_reader_goes_away_finishes_with_every_row_and_its_report(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "harness", "-m", "variant=fused,separate,reference",
         "seq_len=8,16", *[a for a in TINY if not a.startswith("seq_len=")],
         "hydra.sweep.dir=sweep"],
        cwd=tmp_path, env=harness_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    first = proc.stdout.readline()  # `| head -1`: one line read, then the pipe closed
    proc.stdout.close()
    err = proc.stderr.read()
    code = proc.wait(timeout=300)
    assert first.startswith("sweep: 6 points"), first
    assert code == 0, err[-3000:]
    assert "Traceback" not in err and "Logging error" not in err, err[-3000:]
    rows = pd.read_csv(tmp_path / "sweep" / "results.csv")
    assert len(rows) == 6 and (rows["status"] == "ok").all(), rows[["variant", "status"]]
    assert rows["latency_ms_median"].notna().all()  # timed in its rounds, after the pipe closed
    assert (tmp_path / "sweep" / "report.html").exists()


def _command(*args, cwd):
    return subprocess.run([sys.executable, "-m", *args], cwd=cwd, env=harness_env(),
                          capture_output=True, text=True, timeout=120)  # fmt: skip


def test_a_damaged_results_file_is_one_error_line_and_a_damaged_decoration_a_warning(tmp_path):
    good = tmp_path / "good"
    good.mkdir()
    base = dict(variant="fused", label="fused", status="ok", batch=1, seq_len=8, embed_dim=16,
                num_heads=2, dtype="float32", device="cpu", mask="none")  # fmt: skip
    pd.DataFrame([{**base, "seed": i} for i in range(2)]).to_csv(good / "results.csv", index=False)
    for name, content in (("empty", b""), ("binary", bytes(range(256)) * 8)):
        bad = tmp_path / name
        bad.mkdir()
        (bad / "results.csv").write_bytes(content)
        for args in (("harness.report", name), ("harness.report.compare", "good", name),
                     ("harness.report.paired", name, "--ways", "a", "b")):  # fmt: skip
            proc = _command(*args, cwd=tmp_path)
            lines = proc.stderr.strip().splitlines()
            assert proc.returncode == 2 and "Traceback" not in proc.stderr, (args, proc.stderr)
            assert len(lines) == 1 and "results.csv cannot be read as a table" in lines[0], lines
    # what a report only decorates with: damaged, left out with a warning; the report is drawn
    (good / "env.json").write_text('{"torch": ')
    (good / "peak.json").write_text("{")
    (good / "multirun.yaml").write_text(": : [")
    (good / "effects.csv").write_text('"a,b')
    proc = _command("harness.report", "good", cwd=tmp_path)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    for name in ("env.json", "peak.json", "multirun.yaml", "effects.csv"):
        assert f"{name}" in proc.stderr, (name, proc.stderr)
    assert (good / "report.html").exists()


class Unsayable(Exception):
    """A library's exception whose message cannot be read."""

    def __str__(self):
        raise RuntimeError("no words")


class RaisesUnsayable(FusedQKVMHA):
    """A variant that raises it (importable by its dotted path)."""

    def forward(self, *args, **kwargs):
        raise Unsayable()


def test_an_exception_whose_message_raises_is_an_error_row_not_a_dead_worker():
    from harness.factory import make_point
    from harness.point import run_point

    point = make_point("fused", variant={"_target_": f"{__name__}.RaisesUnsayable"},
                       batch=1, seq_len=8, embed_dim=16, num_heads=2, check_only=True)  # fmt: skip
    row = run_point(point)  # before: the RuntimeError of its __str__, out of run_point
    assert row["status"] == "error", row
    assert row["error"].startswith("Unsayable: <its message could not be read: RuntimeError>")


def test_a_stop_while_results_and_report_are_written_waits_for_them(capsys):
    """SIGTERM while the final report rendered exited 143 with no report. Now a stop during the
    gather and the rendering (``finish``) is noted and said, the writing goes on to its end, and
    the run then exits with the stop's code; a second signal stops at once."""
    import os
    import signal

    import pytest

    from harness.errors import Terminated
    from harness.sweep.signals import Deferred

    for sig, code in ((signal.SIGTERM, 143), (signal.SIGHUP, 129), (signal.SIGINT, 130)):
        written = []
        with pytest.raises(SystemExit) as left:
            with Deferred():
                os.kill(os.getpid(), sig)  # handled at the next bytecode, in here
                written.append("report")  # the rest of the writing still runs
        assert written == ["report"] and left.value.code == code
        assert "writing results.csv and the report first" in capsys.readouterr().err
    with pytest.raises(Terminated):
        with Deferred():
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)  # again: now
            written.append("never")
    assert written == ["report"]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handlers restored


def test_a_gate_fails_on_a_variants_own_interrupt_and_on_an_output_that_holds_no_numbers(
    tmp_path,
):
    """check_only, the CI gate: a variant that raises KeyboardInterrupt is an `error` (it read
    "crashed: killed by SIGINT") and one whose output is on the meta device a `mismatch` (it
    read `unsupported`, and the gate passed with exit 0)."""
    from tests.conftest import REPO, run_harness

    faulty = REPO / "tests" / "faulty"
    proc = run_harness(
        "--config-dir", str(faulty), "-m", "variant=interrupts_in_forward,meta_out",
        "check_only=true", *TINY, "hydra.sweep.dir=gate",
        cwd=tmp_path, paths=[faulty],
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-2000:]
    rows = pd.read_csv(tmp_path / "gate" / "results.csv").set_index("variant")
    assert rows.loc["interrupts_in_forward", "status"] == "error"
    assert rows.loc["meta_out", "status"] == "mismatch"
    assert "changed when the checked call was repeated" not in rows.loc["meta_out", "error"]


def test_results_that_disagree_with_their_jobs_and_bad_paths_are_said_in_one_line(tmp_path):
    """A results.csv cut in half rendered 8 of 16 points, a duplicated line 17, both with exit
    0; compare on a JSON file, or into a dir it cannot write, ended in a traceback; a job dir
    outside the sweep dir gave "(no rows)" though every point ran ok."""
    from harness.results import read_results

    proc = _command("harness", "-m", "seed=0,1,2", "check_only=true", *TINY,
                    "hydra.sweep.dir=sweep", cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    sweep = tmp_path / "sweep"
    whole = (sweep / "results.csv").read_text()
    lines = whole.splitlines(keepends=True)
    for damaged in (whole[: len(whole) // 2], "".join(lines + lines[1:2])):
        (sweep / "results.csv").write_text(damaged)
        proc = _command("harness.report", "sweep", cwd=tmp_path)
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
        assert "read from the jobs' rows instead" in proc.stderr, proc.stderr
        assert len(read_results(sweep, [])) == 3
    (sweep / "results.csv").unlink()
    jobs = (sweep / "jobs.json").read_text()
    (sweep / "jobs.json").write_text('{"jobs": [')
    proc = _command("harness.report", "sweep", cwd=tmp_path)
    assert proc.returncode == 0 and "jobs.json is damaged" in proc.stderr, proc.stderr
    assert len(read_results(sweep, [])) == 3
    (sweep / "jobs.json").write_text(jobs)
    (tmp_path / "other.json").write_text('{"a": 1}')
    for args, said in (
        (("sweep", "other.json"), "other.json is not an mha-bench results table"),
        (("sweep", "sweep", "--out", "/proc/none/x.html"), "--out '/proc/none/x.html'"),
    ):
        proc = _command("harness.report.compare", *args, cwd=tmp_path)
        err = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(err) == 1 and said in err[0], proc.stderr
    proc = _command("harness", "-m", "seed=0,1", *TINY, "hydra.sweep.dir=held",
                    "hydra.sweep.subdir=../escaped_${hydra.job.num}", cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 2 and "leaves hydra.sweep.dir" in proc.stderr, proc.stderr
    assert not list(tmp_path.glob("escaped_*"))  # refused before any point ran


def test_a_journal_value_edited_or_impossible_is_read_past_and_said(tmp_path, caplog):
    """Resume took the journal's values as they stood: a sample edited to 1e6 ms made the point
    0.22 ms [0.0074, 6.8] where it was 0.048, and samples of ms <= 0 or NaN were dropped while
    n_samples still counted them. Each line is now sealed with its CRC-32: an edited or
    impossible value is read past like a line cut short, and the count is said."""
    import json
    import logging

    from harness.measure.journal import Journal, Sample

    path = tmp_path / "rounds.jsonl"
    journal = Journal(path)
    for r in range(4):
        journal.append("p", Sample(r, 1.0 + r, 0.048, "run"))
    journal.close()
    lines = path.read_text().splitlines()
    edited = json.loads(lines[1])
    edited["ms"] = 1e6  # the seal no longer matches
    old = {"key": "p", "round": 9, "at": 9.0, "ms": float("nan"), "run": "run"}  # unsealed
    # issue 74: a plausible line whose seal was deleted read as valid
    unsealed = json.loads(lines[2])
    unsealed.pop("crc")
    unsealed["round"] = 7
    lines[1:2] = [json.dumps(edited), json.dumps(old), json.dumps({**old, "ms": -1.0}),
                  json.dumps(unsealed)]  # fmt: skip
    path.write_text("\n".join(lines) + "\n")
    with caplog.at_level(logging.WARNING):
        samples = Journal(path).load("p")
    assert [s.round for s in samples] == [0, 2, 3] and {s.ms for s in samples} == {0.048}
    assert "4 line(s) of the rounds' journal" in caplog.text


def test_a_full_disk_at_a_jobs_set_up_is_one_line_and_exit_3(tmp_path):
    """Hydra writes each job's .hydra/ files before the job runs; on a full disk that raised
    out of the sweep: a traceback and exit 1 (the "check failed" code), no word of the rows."""
    import os
    import shutil

    import pytest

    tiny = tmp_path / "tiny"
    tiny.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root to mount a 24 KiB tmpfs (a full disk on demand)")
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24k", "tmpfs", str(tiny)]).returncode:
        pytest.skip("this machine refused to mount a tmpfs")
    try:
        proc = _command("harness", "-m", "seed=0,1,2", *TINY, f"hydra.sweep.dir={tiny}/sweep",
                        cwd=tmp_path)  # fmt: skip
    finally:
        subprocess.run(["umount", str(tiny)])
    assert proc.returncode == 3 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    said = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert "No space left on device" in said[0] and "resume=true" in said[0], said


def test_a_refused_single_run_leaves_no_husk_and_an_empty_dir_is_no_report(tmp_path):
    """A single run refused for a bad value left its settings, a lock and an empty reports dir,
    which `mha-bench report` drew as a report of 0 points with exit 0."""
    proc = _command("harness", "seq_len=0", "hydra.run.dir=husk", "report_dir=husk/reports",
                    cwd=tmp_path)  # fmt: skip
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and err == ["error: seq_len=0 must be a positive integer"], err
    assert not (tmp_path / "husk").exists()
    (tmp_path / "empty").mkdir()
    proc = _command("harness.report", "empty", cwd=tmp_path)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1 and "holds no rows" in err[0], err
    assert not (tmp_path / "empty" / "report.html").exists()


def test_a_variant_that_does_not_import_is_one_line_once(tmp_path):
    """Hydra's get_class printed its three-line message twice per missing module, and the
    invalid row's error was three lines cut mid-sentence. Now one line, naming what is missing:
    the module itself, a dependency it imports, or the class it lacks."""
    from tests.conftest import run_harness

    cfg = tmp_path / "cfg" / "variant"
    cfg.mkdir(parents=True)
    (tmp_path / "needsdep.py").write_text("import not_installed_anywhere\n")
    (tmp_path / "lacks.py").write_text("X = 1\n")
    for name, target in (("gone", "nosuchmod.Thing"), ("dep", "needsdep.Thing"),
                         ("lacks", "lacks.Thing")):  # fmt: skip
        (cfg / f"{name}.yaml").write_text(f"_target_: {target}\n")
    proc = run_harness("--config-dir", str(tmp_path / "cfg"), "-m", "variant=gone,dep,lacks",
                       "check_only=true", *TINY, "hydra.sweep.dir=sweep", cwd=tmp_path,
                       paths=[tmp_path])  # fmt: skip
    assert "[HYDRA]" not in proc.stdout + proc.stderr and "Traceback" not in proc.stderr
    rows = pd.read_csv(tmp_path / "sweep" / "results.csv").set_index("variant")["error"]
    assert rows["gone"].endswith("cannot import _target_ 'nosuchmod.Thing': no module named "
                                 "'nosuchmod'")  # fmt: skip
    assert rows["dep"].endswith("needsdep imports 'not_installed_anywhere', which is not installed")
    assert rows["lacks"].endswith("lacks has no 'Thing'")
    assert not any("\n" in e for e in rows)


def test_a_process_a_variant_starts_ends_with_the_sweep(tmp_path):
    """A child process that a variant started and that ignores SIGINT and SIGTERM outlived the
    sweep; the worker's whole process group now ends with it."""
    import os
    import time

    from tests.conftest import run_harness

    (tmp_path / "spawns.py").write_text(
        "import subprocess, sys\n"
        "from variants.fused import FusedQKVMHA\n"
        "class Spawns(FusedQKVMHA):\n"
        "    def __init__(self, *a, **k):\n"
        "        super().__init__(*a, **k)\n"
        "        code = ('import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); '\n"
        "                'signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(900)')\n"
        "        child = subprocess.Popen([sys.executable, '-c', code])\n"
        f"        open({str(tmp_path / 'child.pid')!r}, 'w').write(str(child.pid))\n"
    )
    (tmp_path / "cfg" / "variant").mkdir(parents=True)
    (tmp_path / "cfg" / "variant" / "spawns.yaml").write_text("_target_: spawns.Spawns\n")
    proc = run_harness(
        "--config-dir",
        str(tmp_path / "cfg"),
        "variant=spawns",
        "check_only=true",
        *TINY,
        "hydra.run.dir=run",
        cwd=tmp_path,
        paths=[tmp_path],
        timeout=240,
    )  # fmt: skip (before: held the pipes 900 s)
    assert proc.returncode == 0, proc.stderr[-2000:]
    pid = int((tmp_path / "child.pid").read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        if open(f"/proc/{pid}/stat").read().split()[2] == "Z":
            return  # ended; its parent gone, not yet reaped by init
        time.sleep(0.2)
    os.kill(pid, 9)
    raise AssertionError("the variant's child process outlived the run")


def test_a_quoted_value_works_in_a_sweep_as_in_a_single_run(tmp_path):
    """``variant.tag='a<b'`` ran in a single run and was refused under -m: the sweep handed the
    job its value without the quotes, which Hydra's grammar cannot read."""
    from tests.conftest import run_harness

    (tmp_path / "tagged.py").write_text(
        "from variants.fused import FusedQKVMHA\n"
        "class Tagged(FusedQKVMHA):\n"
        "    def __init__(self, *a, tag='', **k):\n"
        "        super().__init__(*a, **k)\n"
    )
    (tmp_path / "cfg" / "variant").mkdir(parents=True)
    (tmp_path / "cfg" / "variant" / "tagged.yaml").write_text("_target_: tagged.Tagged\ntag: x\n")
    for given, want in (("'a<b'", ["tagged/tag=a<b"]),
                        ("'a<b',\"it's\"", ["tagged/tag=a<b", "tagged/tag=it's"])):  # fmt: skip
        proc = run_harness("--config-dir", str(tmp_path / "cfg"), "-m", "variant=tagged",
                           f"variant.tag={given}", "check_only=true", *TINY,
                           "hydra.sweep.dir=sweep", cwd=tmp_path, paths=[tmp_path])  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-2000:]
        labels = sorted(pd.read_csv(tmp_path / "sweep" / "results.csv")["label"])
        assert labels == want, labels


def test_more_threads_than_cores_is_said(tmp_path):
    """num_threads=64 on a 2-core machine ran without a word, and its rounds read as busy."""
    from harness.envinfo import available_cores, threads_said

    cores = available_cores()
    assert "more threads than cores" in threads_said([cores + 1], cores)
    assert "more threads than cores" not in threads_said([cores], cores)
    proc = _command("harness", "check_only=true", *TINY, f"num_threads={cores + 62}",
                    "hydra.run.dir=run", cwd=tmp_path)  # fmt: skip
    warned = [x for x in proc.stderr.splitlines() if x.startswith("warning: num_threads=")]
    assert proc.returncode == 0 and len(warned) == 1, proc.stderr[-2000:]
    assert "more threads than cores" in warned[0]


def _numeric_keys():
    """Every key of the point, its timing and its profiler options whose value is a number."""
    import dataclasses
    import typing

    from harness.config import Point
    from harness.config_measure import ProfilerOptions, Timing

    for cls, group in ((Point, None), (Timing, "timing"), (ProfilerOptions, "profiler")):
        for f in dataclasses.fields(cls):
            kind = typing.get_type_hints(cls)[f.name]
            if {int, float} & set(typing.get_args(kind) or (kind,)):
                yield group, f.name


def test_every_numeric_key_refuses_what_no_run_could_mean_in_one_line():
    """Issue 58: inf, nan and a value past any meaning (1e20: a typo, or an inf in disguise)
    were taken by some keys, then hung a point or overflowed a tensor. Every numeric key the
    config has, found from the dataclasses (a key added later is checked too)."""
    import pytest

    from harness.config import InvalidPoint
    from harness.factory import make_point

    keys = list(_numeric_keys())
    assert len(keys) >= 20 and (None, "batch") in keys and ("timing", "rounds") in keys
    for group, name in keys:
        where = f"{group}.{name}" if group else name
        for value in (float("inf"), float("nan"), 10**20, 1e20):
            # no limit on time (point_timeout=null): the key's own bound must refuse it
            given = {"point_timeout": None, "profile": True, "mask": "sliding", "window": 4}
            given.update({name: value} if group is None else {group: {name: value}})
            with pytest.raises(InvalidPoint) as refused:
                make_point("fused", **given)
            said = str(refused.value)
            assert said.startswith(f"{where}=") and "\n" not in said, (where, value, said)
    with pytest.raises(InvalidPoint, match=r"timing.rounds=100 of .* every point would time out"):
        make_point("fused", point_timeout=10, timing={"rounds": 100, "round_time": 0.1})
