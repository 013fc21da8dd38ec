#!/usr/bin/env bash
# The GPU readiness kit in one call: bash benchmarks/gpu/run.sh [--dry-run] [--stages a,b]
# Results go to $OUT (the lent machine's return folder), else ./gpu-results.
# On the lent GPU machine (no network): first installs what it lacks from the wheels that
# benchmarks/gpu/prepare.sh put in benchmarks/gpu/wheels, then the project from this tree.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-$PWD/gpu-results}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
if [[ " $* " != *" --dry-run "* ]]; then
  if compgen -G "benchmarks/gpu/wheels/*.whl" > /dev/null; then
    "$PY" -m pip install --quiet --no-deps --no-index benchmarks/gpu/wheels/*.whl
  else
    echo "benchmarks/gpu/wheels is empty: run benchmarks/gpu/prepare.sh first" >&2
  fi
  "$PY" -m pip install --quiet --no-deps --no-build-isolation --no-index -e .
fi
exec "$PY" benchmarks/gpu/gpu_check.py --out "$OUT" "$@"
