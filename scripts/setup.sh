#!/usr/bin/env bash
# Install mha-bench (editable) and its dependencies into the active Python.
#
#   PYTHON=python3   the interpreter to install into (a venv's or conda env's python works)
#   EXTRAS=test      optional extras to add (test: pytest, pytest-benchmark)
#   TORCH_SPEC=...   what to install when no torch is present (default torch==2.13.0)
#
# An installed torch (a CUDA build, say) is kept: it is never upgraded or replaced. With no
# torch, TORCH_SPEC is installed first and explicitly, because an unpinned `torch` pulled in as
# a dependency takes the registry's newest (multi-GB CUDA) build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
EXTRAS=${EXTRAS:-}

"$PYTHON" - <<'PY'
import sys
if not ((3, 11) <= sys.version_info[:2] < (3, 14)):
    sys.exit(f"setup: Python {sys.version.split()[0]} is not supported: mha-bench needs 3.11 to 3.13 "
             "(Hydra 1.3 fails on 3.14)")
PY

if have=$("$PYTHON" -c 'import torch; print(torch.__version__)' 2>/dev/null); then
    "$PYTHON" - "$have" <<'PY'
import sys
major, minor = (int(x) for x in sys.argv[1].split("+")[0].split(".")[:2])
if not (2, 2) <= (major, minor) < (3, 0):
    sys.exit(f"setup: torch {sys.argv[1]} is installed but mha-bench needs torch>=2.2,<3; "
             "upgrade it yourself (this script never replaces an installed torch)")
PY
    echo "setup: keeping installed torch $have"
else
    echo "setup: no torch found, installing $TORCH_SPEC"
    "$PYTHON" -m pip install --quiet "$TORCH_SPEC"
fi

# constraints.txt pins the other dependencies to the versions tested here; torch is not in it,
# and is pinned to the installed build instead, so no dependency can replace it.
target="."
[ -n "$EXTRAS" ] && target=".[$EXTRAS]"
pin=$(mktemp)
trap 'rm -f "$pin"' EXIT
# the version pip knows torch by (its metadata), read without importing torch: torch's import
# warns "Failed to initialize NumPy" while numpy is not installed yet (a fresh venv, where numpy
# comes with the install below), and a CUDA wheel's torch.__version__ (2.13.0+cu130) is not
# pip's (2.13.0)
"$PYTHON" -c 'from importlib.metadata import version; print("torch==" + version("torch"))' > "$pin"
"$PYTHON" -m pip install --quiet --constraint constraints.txt --constraint "$pin" -e "$target"
echo "setup: ok ($("$PYTHON" -c 'import torch; print("torch", torch.__version__, "cuda" if torch.cuda.is_available() else "cpu")'))"
echo "setup: $("$PYTHON" -c 'from harness.envinfo import where_command; print(where_command())')"
