"""What an operator does to a run, answered in one line with nothing lost (issue 58): here, a
reader that goes away (``mha-bench run -m ... | head -2``)."""

import subprocess
import sys

import pandas as pd

from tests.conftest import TINY, harness_env


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
