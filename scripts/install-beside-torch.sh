#!/usr/bin/env bash
# Install packages next to mha-bench without replacing the installed torch:
#
#   bash scripts/install-beside-torch.sh timm transformers     (PYTHON=... picks the interpreter)
#
# pip resolves the packages' requirements with torch pinned to the build that is installed (a
# constraints file), so a library that asks for `torch`, or for a newer one, cannot swap a CPU
# build for the registry's multi-GB CUDA one, nor a cluster's CUDA build for another. If a
# package needs a torch other than yours, pip refuses and says which: choose a version of the
# package that fits (pip install 'timm<1.1' ...), or upgrade torch yourself, on purpose.
set -euo pipefail
PYTHON=${PYTHON:-python3}
[ $# -gt 0 ] || { echo "usage: bash scripts/install-beside-torch.sh PACKAGE [PACKAGE ...]" >&2; exit 2; }
pin=$(mktemp)
trap 'rm -f "$pin"' EXIT
"$PYTHON" -c 'import torch; print(f"torch=={torch.__version__}")' > "$pin" || {
    echo "install-beside-torch: no torch in $PYTHON; run bash scripts/setup.sh first" >&2; exit 2; }
echo "install-beside-torch: keeping $(cat "$pin")"
"$PYTHON" -m pip install --constraint "$pin" "$@"
"$PYTHON" -c 'import torch; print("install-beside-torch: ok, torch", torch.__version__)'
