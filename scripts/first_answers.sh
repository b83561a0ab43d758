#!/usr/bin/env bash
# From a fresh clone to the two answers a new user comes for (issue 57), each timed:
#   1. "is my module right?"   mha-bench run -m ... check_only=true   (examples/mine.py: bias-free)
#   2. "which way for my shape?" mha-bench race mine ...             (it against every built-in way)
#   3. one point check_only from the command line against `python -c "import torch"`, three
#      times each, alternating (the target: at most twice the import)
# Usage: bash scripts/first_answers.sh [SHAPE OVERRIDES...]   (default: seq_len=512 mask=causal)
# Run it in a fresh clone after `make setup` (PYTHON=... picks the interpreter, as make does);
# docs/measurements.md has its figures.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
BIN=$(dirname "$("$PYTHON" -c 'import sys; print(sys.executable)')")
MHA="$BIN/mha-bench"
[ -x "$MHA" ] || MHA="$PYTHON -m harness.cli"
SHAPE=("$@")
[ ${#SHAPE[@]} -gt 0 ] || SHAPE=(seq_len=512 mask=causal)
OUT=${OUT:-results/first-answers}
rm -rf "$OUT"
timed() {  # label, command...: the command's output tail and its wall time
    local label=$1; shift
    local t0=$SECONDS rc=0
    "$@" >"$OUT.$label.log" 2>&1 || rc=$?
    grep -E "^(check|check failed|finding: race|results):" "$OUT.$label.log" | cut -c1-400 || true
    echo "first-answers: $label: $((SECONDS - t0)) s (exit $rc)"
}
mkdir -p "$(dirname "$OUT")"
timed right $MHA run -m --config-dir examples/conf variant=mine,reference \
    mask=none,causal,padding mode=fwd,fwd_bwd dtype=float32,bfloat16 check_only=true \
    "hydra.sweep.dir=$OUT/right"
timed race $MHA race mine --config-dir examples/conf "${SHAPE[@]}" "hydra.sweep.dir=$OUT/race"
median() { sort -n | awk '{v[NR]=$1} END {print v[int((NR+1)/2)]}'; }
wall() { local t0 t1; t0=$(date +%s.%N); "$@" >/dev/null 2>&1 || true; t1=$(date +%s.%N); echo "$t1 - $t0" | bc; }
IMPORTS=() CHECKS=()
for i in 1 2 3; do
    IMPORTS+=("$(wall "$PYTHON" -c "import torch")")
    CHECKS+=("$(wall $MHA run check_only=true "hydra.run.dir=$OUT/one-$i")")
done
I=$(printf '%s\n' "${IMPORTS[@]}" | median) C=$(printf '%s\n' "${CHECKS[@]}" | median)
echo "first-answers: one point check_only: ${C} s (median of 3; ${CHECKS[*]}), import torch ${I} s (${IMPORTS[*]}): $(echo "scale=2; $C / $I" | bc)x"
