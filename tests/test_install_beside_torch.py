"""scripts/install-beside-torch.sh fails when pip reports a dependency conflict, which pip itself
exits 0 after. Without network: ``python -m pip`` is a stub module first on PYTHONPATH that prints
what pip would and exits as asked."""

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
