"""The docs stay true, and each idea is added in one place.

The reference (config keys, result columns, kernels) and the toggles preset are generated from
the code (harness/docs.py); a column and a config key are each added by editing one file of a
copy of this repository, and show up end to end.
"""

import json
import os
import re
import shutil
import subprocess
import sys

import pandas as pd
import pytest

from harness import docs
from harness.report.busy import contended
from tests.conftest import REPO, TINY, python_env

PAGES = [
    "guide.md",
    "adding.md",
    "reference.md",
    "methodology.md",
    "measurements.md",
    "architecture.md",
]


def test_generated_files_are_fresh():
    stale = [
        str(p.relative_to(REPO)) for p, make in docs.GENERATED.items() if p.read_text() != make()
    ]
    assert not stale, f"{stale} are stale: run make docs"


def test_readme_is_a_short_guide_and_docs_hold_the_rest():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    assert [p for p in PAGES if not (REPO / "docs" / p).exists() or f"docs/{p}" not in readme] == []
    assert "python -m harness " not in readme  # mha-bench is the command


def test_every_cited_docs_section_exists():
    """Code and docs cite `docs/<page>.md, "Section"`: every such section is a heading there."""
    headings = {
        p: {
            re.sub(r"^#+\s*", "", line).strip()
            for line in (REPO / "docs" / p).read_text().splitlines()
            if line.startswith("#")
        }
        for p in PAGES
    }
    cite = re.compile(r'docs/([a-z]+\.md),?\s+"([^"]+)"')
    files = [
        *REPO.glob("harness/**/*.py"),
        *REPO.glob("variants/**/*.py"),
        *REPO.glob("conf/**/*.yaml"),
        *REPO.glob("docs/*.md"),
        REPO / "README.md",
        *REPO.glob("hydra_plugins/**/*.py"),
    ]
    wrong = []
    for path in files:
        text = re.sub(
            r"\s*\n\s*#?\s*", " ", path.read_text()
        )  # citations wrap across comment lines
        for page, section in cite.findall(text):
            if page not in headings or not any(h.startswith(section) for h in headings[page]):
                wrong.append(f'{path.relative_to(REPO)}: docs/{page}, "{section}"')
    assert not wrong, "\n".join(wrong)


def test_nothing_cites_a_design_document_outside_the_repository():
    files = [
        *REPO.glob("harness/**/*.py"),
        *REPO.glob("variants/**/*.py"),
        *REPO.glob("docs/*.md"),
        REPO / "README.md",
        *REPO.glob("tests/*.py"),
    ]
    assert [
        str(p.relative_to(REPO))
        for p in files
        if "DESIGN.md" in p.read_text() and p.name != "test_docs.py"
    ] == []


def run_in(root, *args, module="harness"):
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=root,
        env=python_env(root, env=dict(os.environ)),
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow  # a copy of the repository swept (16 s here): make test-slow and CI run it
def test_a_column_is_added_in_one_place(copy):
    schema = copy / "harness" / "schema.py"
    text = schema.read_text()
    line = (  # a field of a part of the record
        '    tokens_per_call: int | None = col("tokens", "B x L: query tokens in one call",\n'
        '        table=True, compute=lambda row: row["batch"] * row["seq_len"])\n'
    )
    anchor = "    overrides: str | None = col("
    assert text.count(anchor) == 1
    schema.write_text(text.replace(anchor, line + anchor))
    proc = run_in(copy, "-m", "seq_len=8,16", *TINY, "hydra.sweep.dir=sweep")
    assert proc.returncode == 0, proc.stderr[-2000:]
    df = pd.read_csv(copy / "sweep" / "results.csv")
    assert df["tokens_per_call"].tolist() == (df["batch"] * df["seq_len"]).tolist()
    html = (copy / "sweep" / "report.html").read_text()
    assert "tokens_per_call" in html
    assert (
        run_in(copy, "--check", module="harness.docs").returncode == 1
    )  # the reference must follow
    assert run_in(copy, module="harness.docs").returncode == 0
    assert "| `tokens_per_call` | tokens | B x L" in (copy / "docs" / "reference.md").read_text()


def add_field(copy, before: str, line: str) -> None:
    """``line`` added to the copy's Point, above the field that starts with ``before``."""
    config = copy / "harness" / "config.py"
    text = config.read_text()
    field = f"    {before}"
    assert text.count(field) == 1
    config.write_text(text.replace(field, f"    {line}\n" + field))


@pytest.mark.slow  # a copy of the repository swept (12 s here): make test-slow and CI run it
def test_a_config_key_is_added_in_one_place(copy):
    note = 'note: str = key("", "free text carried by the point")'
    add_field(copy, "report_dir: str = key(", note)
    ok = run_in(copy, "note=hello", "check_only=true", *TINY, "hydra.run.dir=run")
    assert ok.returncode == 0, ok.stderr[-2000:]
    typo = run_in(copy, "nte=hello", *TINY, "hydra.run.dir=run2")
    assert typo.returncode == 2 and "nte is not a config key (did you mean note?)" in typo.stderr
    assert run_in(copy, module="harness.docs").returncode == 0
    assert (
        "| `note` | `` | free text carried by the point |"
        in (copy / "docs" / "reference.md").read_text()
    )


SCORES_KERNEL = '''"""Manual attention with the softmax in float32: it holds the (L, S) scores."""
import math

import torch

from variants.kernels import Kernel


def attend(q, k, v, m):  # q (B, H, L, D), k/v (B, H, S, D) -> (B, H, L, D)
    scores = (q @ k.transpose(-2, -1)).float() / math.sqrt(q.size(-1))  # (B, H, L, S)
    if m.causal:
        hidden = torch.ones(m.L, m.S, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(hidden, float("-inf"))
    mask = m.merged(torch.float32)
    if mask is not None:
        scores = scores + mask
    return scores.softmax(dim=-1).to(v.dtype) @ v


KERNEL = Kernel(
    name="softmax32",
    title="float32-softmax attention",
    fn=attend,
    scores=True,  # the memory estimate and the memory finding follow
    order=5,  # after manual, before sdpa (10): the baseline of sdpa and flex
    doc="matmul, float32 softmax, matmul (the scores are materialised)",
)
'''


OUTSIDE_KERNEL = '''"""A kernel outside the repository: SDPA under another name."""
import torch.nn.functional as F

from variants.kernels import Kernel

KERNEL = Kernel(
    name="mine.fast",
    title="my outside attention",
    fn=lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, is_causal=m.causal),
    masks=("none", "causal"),
    order=-1,  # before manual: the baseline of every pair it is in
    memory="it keeps no scores of its own",
    doc="SDPA under another name",
)
'''


@pytest.mark.slow  # a copy of the repository, made docs and swept (20-56 s here): CI runs it
def test_a_kernel_is_one_file_and_its_memory_baseline_and_title_follow(copy, tmp_path):
    """One file in variants/kernels/ and nothing else: git status shows that file alone after
    make docs; the kernel joins kernels() (the presets' sweep) and mha-bench kernels; one that
    holds its (L, S) scores is budgeted for them as manual is (mem_estimate_mb), takes its place
    in the baseline order (the baseline of sdpa, manual's alternative), and the memory finding
    sets it against sdpa (one holds the scores, the other does not), not against manual. A
    kernel outside the repository gets its title, order and memory into the report too."""
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "copy"]):
        subprocess.run([*git, *args], cwd=copy, check=True, capture_output=True)
    (copy / "variants" / "kernels" / "softmax32.py").write_text(SCORES_KERNEL)
    assert run_in(copy, "--check", module="harness.docs").returncode == 0  # nothing to regenerate
    assert run_in(copy, module="harness.docs").returncode == 0
    status = subprocess.run(
        ["git", "status", "--porcelain"], cwd=copy, capture_output=True, text=True, check=True
    ).stdout
    assert status.splitlines() == ["?? variants/kernels/softmax32.py"], status
    listed = run_in(copy, "kernels", module="harness.cli")
    assert listed.returncode == 0, listed.stderr[-2000:]
    assert "| `softmax32` | matmul, float32 softmax" in listed.stdout
    assert "kernels(): manual,softmax32,sdpa,flex" in listed.stdout  # the presets' sweep

    outside = tmp_path / "outside" / "mine"
    outside.mkdir(parents=True)
    (outside / "__init__.py").write_text("")
    (outside / "fast.py").write_text(OUTSIDE_KERNEL)
    tiny = [a for a in TINY if not a.startswith("seq_len=")]
    sweep = ["variant=fused", "variant.attention=manual,softmax32,sdpa,mine.fast", "seq_len=16,128"]
    proc = subprocess.run(
        [sys.executable, "-m", "harness", "-m", *sweep, *tiny, f"hydra.sweep.dir={tmp_path / 's'}"],
        cwd=copy,
        env=python_env(copy, env={**os.environ, "PYTHONPATH": str(outside.parent)}),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = pd.read_csv(tmp_path / "s" / "results.csv")
    fused = rows[rows["variant"] == "fused"]
    estimate = fused.set_index(
        [fused["variant_options"].str.extract(r"attention=([\w.]+)")[0], "seq_len"]
    )["mem_estimate_mb"]
    for L in (16, 128):
        assert estimate["softmax32", L] == estimate["manual", L] > estimate["sdpa", L]
    ways = json.loads((tmp_path / "s" / "ways.json").read_text())
    assert ways["kernels"]["mine.fast"]["order"] == -1
    assert ways["titles"]["attention"]["softmax32"] == "float32-softmax attention"

    effects = pd.read_csv(tmp_path / "s" / "effects.csv")
    pairs = set(
        effects.loc[effects["factor"] == "attention", ["baseline", "alternative"]].itertuples(
            index=False, name=None
        )
    )
    assert {("manual", "softmax32"), ("manual", "sdpa"), ("softmax32", "sdpa")} <= pairs
    assert {("mine.fast", k) for k in ("manual", "softmax32", "sdpa")} <= pairs  # its order: -1

    memory = [line for line in proc.stdout.splitlines() if line.startswith("finding: memory:")]
    assert any(
        "float32-softmax attention" in line
        and "its (L, L) scores alone grow 64x" in line
        and "F.scaled_dot_product_attention" in line
        for line in memory
    ), memory
    both_hold_scores = ("manual softmax attention", "float32-softmax attention")
    assert not any(all(title in line for title in both_hold_scores) for line in memory)
    assert any(
        "my outside attention" in line and "it keeps no scores of its own" in line
        for line in memory
    ), memory
    said = [line for line in proc.stdout.splitlines() if line.startswith("finding: attention:")]
    assert any("my outside attention" in line for line in said), said  # by its title


@pytest.mark.slow  # a copy of the repository, swept twice (28 s here): make test-slow and CI run it
def test_a_shape_key_is_added_in_one_place_and_compare_effects_and_resume_follow_it(copy):
    """One field with role=shape, and nothing else: results.csv gets its column, compare matches
    rows on it, effects pair within it, resume keys its rows by it, the reference lists it.
    Three small sweeps in a copy of the repository (about 40 s): the roles are read where a
    sweep runs, in subprocesses, so nothing less shows that they are honoured."""
    salt = 'salt: int = key(0, "a test\'s extra shape key", role="shape")'
    add_field(copy, "seed: int = key(", salt)
    sweep = ["-m", "variant=fused,separate", *TINY, "hydra.sweep.dir=a"]
    proc = run_in(copy, *sweep, "salt=0,1")
    assert proc.returncode == 0, proc.stderr[-2000:]
    a = copy / "a"
    rows = pd.read_csv(a / "results.csv")
    assert sorted(rows["salt"]) == [0, 0, 1, 1] and set(rows["status"]) == {"ok"}
    # effects: the structure pair once per salt, never across them
    effects = pd.read_csv(a / "effects.csv")
    structure = effects[effects["factor"] == "structure"]
    assert sorted(structure["salt"]) == [0, 1], structure
    # compare: one row to one row (a key missing from the match would pair 4 x 2 = 8)
    shutil.copytree(a, copy / "b")
    # a wide gate: this checks the matching, not timing (tiny points' intervals reach +-100%,
    # which the default 5% threshold calls "cannot tell")
    out = run_in(copy, "a", "b", "--threshold", "9", module="harness.report.compare")
    busy = contended(rows).any()  # timed on a busy machine: not comparable (exit 3), never judged
    assert out.returncode == (3 if busy else 0), out.stdout + out.stderr
    assert "of 4 matched points" in out.stdout, out.stdout + out.stderr
    # resume: salt=0's rows are kept, salt=2's run anew (a hash without salt would keep salt=1's)
    kept = rows[rows["salt"] == 0].set_index("variant")["latency_ms_median"]
    proc = run_in(copy, *sweep, "salt=0,2", "resume=true")
    assert proc.returncode == 0, proc.stderr[-2000:]
    again = pd.read_csv(a / "results.csv")
    assert sorted(again["salt"]) == [0, 0, 2, 2]
    assert again[again["salt"] == 0].set_index("variant")["latency_ms_median"].equals(kept)
    assert run_in(copy, module="harness.docs").returncode == 0
    assert (
        "| `salt` | `0` | a test's extra shape key |"
        in (copy / "docs" / "reference.md").read_text()
    )


def test_the_setup_says_where_mha_bench_is_and_how_to_call_it(tmp_path):
    """make setup's last line (issue 57): the command's path, on the PATH or not; how to call it
    when its folder is not on the PATH (a venv not activated, PYTHON=...), or another comes
    first; and the module when pip made no command."""
    from harness.envinfo import where_command

    bin_ = tmp_path / "venv" / "bin"
    bin_.mkdir(parents=True)
    exe = bin_ / "mha-bench"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    other = tmp_path / "other"
    other.mkdir()
    assert where_command(scripts=str(bin_), path=str(bin_)) == (
        f"mha-bench is {exe}, on your PATH: try `mha-bench --help`"
    )
    off = where_command(scripts=str(bin_), path=str(other))
    assert f"not on your PATH: call it as {exe}, or add {bin_} to PATH" in off
    (other / "mha-bench").write_text("#!/bin/sh\n")
    (other / "mha-bench").chmod(0o755)
    shadowed = where_command(scripts=str(bin_), path=f"{other}:{bin_}")
    assert f"({other / 'mha-bench'} comes first there)" in shadowed
    assert "-m harness" in where_command(scripts=str(other / "none"), path=str(other))
    # the set-up script prints it last
    setup = (REPO / "scripts" / "setup.sh").read_text().strip().splitlines()
    assert "where_command" in setup[-1]
