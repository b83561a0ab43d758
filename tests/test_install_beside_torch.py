"""scripts/install-beside-torch.sh fails when pip reports a dependency conflict, which pip itself
exits 0 after. Without network: ``python -m pip`` is a stub module first on PYTHONPATH that prints
what pip would and exits as asked. Also scripts/setup.sh's pin of torch, read the same way."""

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

SCRIPT = REPO / "scripts" / "install-beside-torch.sh"
CONFLICTS = [
    "ERROR: pip's dependency resolver does not currently take into account all the packages "
    "that are installed. This behaviour is the source of the following dependency conflicts.\n"
    "timm 1.0.0 requires torchvision, which is not installed.",
    "transformers 4.0.0 requires tokenizers<0.10, but you have tokenizers 0.21.0 which is "
    "incompatible.",
    "somepkg 1.0 has requirement numpy<2, but you have numpy 2.1.0.",
]


def install(tmp_path, said: str, code: int = 0):
    stub = tmp_path / "stub" / "pip"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("")
    (stub / "__main__.py").write_text(
        f"import sys\nprint('Successfully installed fakepkg-1.0')\nprint({said!r})\n"
        f"sys.exit({code})\n"
    )
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(tmp_path / "stub")}
    return subprocess.run(
        ["bash", str(SCRIPT), "fakepkg"], env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("said", CONFLICTS)
def test_a_reported_conflict_fails_the_script(tmp_path, said):
    proc = install(tmp_path, said)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert said.splitlines()[0] in proc.stdout  # pip's own words are shown
    assert "pip reported a dependency conflict" in proc.stderr
    assert "ok, torch" not in proc.stdout


def test_a_clean_install_passes_and_a_failed_one_keeps_pips_exit_code(tmp_path):
    proc = install(tmp_path, "nothing to report")
    assert proc.returncode == 0 and "install-beside-torch: ok, torch" in proc.stdout, proc.stderr
    failed = install(tmp_path / "again", "ERROR: No matching distribution found", code=3)
    assert failed.returncode == 3


def test_torch_is_pinned_as_pip_knows_it_not_as_it_says_at_import(tmp_path):
    """Issue 73: a CUDA wheel says 2.13.0+cu130 at import where pip knows 2.13.0; the pin is what
    pip knows (the distribution's metadata), else every package requiring torch is unresolvable."""
    from importlib.metadata import version

    stub = tmp_path / "stub" / "pip"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("")
    (stub / "__main__.py").write_text(  # prints the constraints file it was handed
        "import sys\nprint(open(sys.argv[sys.argv.index('--constraint') + 1]).read())\n"
    )
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(tmp_path / "stub")}
    proc = subprocess.run(
        ["bash", str(SCRIPT), "fakepkg"], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert f"torch=={version('torch')}\n" in proc.stdout


def test_the_setup_reads_torchs_version_without_the_numpy_warning_of_a_fresh_venv(tmp_path):
    """Issue 74: in a fresh venv torch comes before numpy (pip installs numpy with mha-bench), and
    ``import torch`` there warns "Failed to initialize NumPy": the set-up pins torch by its
    metadata instead, with no import. A numpy stub that fails to import stands for the missing
    numpy; the pip stub 'installs' numpy (removes the stub) and prints the pin it was handed."""
    from importlib.metadata import version

    stub = tmp_path / "stub"
    (stub / "numpy").mkdir(parents=True)
    missing = "raise ModuleNotFoundError(\"No module named 'numpy'\")\n"
    (stub / "numpy" / "__init__.py").write_text(missing)
    (stub / "pip").mkdir()
    (stub / "pip" / "__init__.py").write_text("")
    (stub / "pip" / "__main__.py").write_text(
        "import shutil, sys\n"
        f"shutil.rmtree({str(stub / 'numpy')!r})\n"
        "pins = [a for i, a in enumerate(sys.argv) if sys.argv[i - 1] == '--constraint']\n"
        "print(open(pins[-1]).read())\n"
    )
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(stub)}
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "setup.sh")],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "NumPy" not in proc.stderr, proc.stderr
    assert f"torch=={version('torch')}\n" in proc.stdout
