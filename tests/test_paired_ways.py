"""Any two named ways paired: ``mha-bench paired DIR --ways A B`` on a sweep with a
planted 1.2x difference (tests/paced/: the same forward 6 and 5 times per call) gives an
interval that covers 1.2 at every shape and overall, and the report shows it."""

import pandas as pd

from harness.report import paired
from tests.conftest import REPO

PACED = REPO / "tests" / "paced"


def test_a_planted_1_2x_difference_is_found_with_an_interval_that_covers_it(
    harness_cli, tmp_path, capsys
):
    proc = harness_cli(
        "-m",
        "--config-dir",
        str(PACED / "conf"),
        "variant=six_ms,five_ms",
        "seq_len=64,128",
        "embed_dim=64",
        "num_heads=4",
        "timing.rounds=8",
        "timing.round_time=0.2",
        "num_threads=1",  # two OpenMP threads on a loaded 2-core machine stall for seconds
        "hydra.sweep.dir=sweep",
        paths=[PACED],
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    root = tmp_path / "sweep"
    assert paired.main([str(root), "--ways", "six_ms", "five_ms", "--no-report"]) == 0
    table = pd.read_csv(root / paired.PAIRED_FILE)
    assert list(table["shape"])[-1] == "all shapes" and len(table) == 3  # two shapes, overall
    for row in table.to_dict("records"):
        assert row["ratio_ci_low"] <= 1.2 <= row["ratio_ci_high"], row
        assert 1.1 < row["ratio"] < 1.3, row
    assert (table["basis"].iloc[:2] == "rounds").all()  # paired from the journal, not speedups
    out = capsys.readouterr().out
    assert "B is faster" in out and "all shapes" in out
    # the report shows it once it was asked for
    from harness.report.render import render_dir

    html = render_dir(root, tmp_path / "reports").read_text()
    assert 'id="paired"' in html and "five_ms" in html


def test_a_label_that_names_no_way_or_several_is_refused_in_one_line(tmp_path, capsys):
    rows = pd.DataFrame(
        [
            dict(
                variant="fused",
                label="fused/a",
                status="ok",
                latency_ms_median=1.0,
                batch=1,
                seq_len=8,
                embed_dim=16,
                num_heads=2,
                dtype="float32",
                device="cpu",
                mask="none",
                mode="fwd",
            ),
            dict(
                variant="fused",
                label="fused/b",
                status="ok",
                latency_ms_median=1.0,
                batch=1,
                seq_len=8,
                embed_dim=16,
                num_heads=2,
                dtype="float32",
                device="cpu",
                mask="none",
                mode="fwd",
            ),
        ]
    )
    rows.to_csv(tmp_path / "results.csv", index=False)
    assert paired.main([str(tmp_path), "--ways", "nope", "fused/a", "--no-report"]) == 2
    assert "'nope' names no timed way" in capsys.readouterr().err
    assert paired.main([str(tmp_path), "--ways", "fused", "fused/a", "--no-report"]) == 2
    err = capsys.readouterr().err
    assert "'fused' names 2 ways" in err and "name one" in err
