#!/usr/bin/env bash
# Run on a machine with the package registries, before a GPU is lent: downloads the wheels the
# lent machine lacks (it has torch, triton, transformers, safetensors, tokenizers, numpy,
# pytest, hypothesis and psutil; not pydantic, llguidance or a new enough setuptools) for its
# Python 3.12 on x86_64 Linux, into benchmarks/gpu/wheels (git-ignored; carry it to the run).
set -euo pipefail
cd "$(dirname "$0")/../.."
DEST=benchmarks/gpu/wheels
PY="${PYTHON:-.venv/bin/python}"
rm -rf "$DEST"
mkdir -p "$DEST"
"$PY" -m pip download --quiet --dest "$DEST" --only-binary=:all: \
  --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64 \
  "pydantic>=2.6" "llguidance>=1.9" "setuptools>=68" wheel
ls "$DEST"
du -sh "$DEST"
