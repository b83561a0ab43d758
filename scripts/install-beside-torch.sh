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
# pip installs and exits 0 when the new packages break a requirement of one already installed
# ("pip's dependency resolver does not currently take into account ...", "... has requirement
# ..., but you have ...", "... which is incompatible"): this script then exits 1, naming it.
set -euo pipefail
PYTHON=${PYTHON:-python3}
[ $# -gt 0 ] || { echo "usage: bash scripts/install-beside-torch.sh PACKAGE [PACKAGE ...]" >&2; exit 2; }
pin=$(mktemp)
said=$(mktemp)
trap 'rm -f "$pin" "$said"' EXIT
# the version pip knows the installed distribution by (its metadata), not torch.__version__: a
# CUDA wheel from PyPI says 2.13.0+cu130 at import and 2.13.0 to pip, and a pin of the former
# makes every package that requires torch unresolvable
"$PYTHON" -c 'from importlib.metadata import version; print("torch==" + version("torch"))' \
    > "$pin" 2>/dev/null || {
    echo "install-beside-torch: no torch in $PYTHON; run bash scripts/setup.sh first" >&2; exit 2; }
echo "install-beside-torch: keeping $(cat "$pin")"
"$PYTHON" -m pip install --constraint "$pin" "$@" 2>&1 | tee "$said"
if grep -Eq "dependency resolver does not currently take into account|has requirement .*but you have|but you have .* which is incompatible" "$said"; then
    echo "install-beside-torch: pip reported a dependency conflict (above); the packages were" \
        "installed, but one installed package's requirement is broken: choose versions that fit" >&2
    exit 1
fi
"$PYTHON" -c 'import torch; print("install-beside-torch: ok, torch", torch.__version__)'
