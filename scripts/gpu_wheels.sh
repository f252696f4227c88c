#!/usr/bin/env bash
# Wheels for scripts/gpu_check.sh on a GPU machine that cannot reach a package index and whose
# python has torch but not witness's other needs (Ed25519 signing and BLAKE3).
#
#   scripts/gpu_wheels.sh DIR [PYTHON_VERSION]     (default 3.12; then WITNESS_WHEELS=DIR there)
set -euo pipefail
dir=${1:?usage: scripts/gpu_wheels.sh DIR [PYTHON_VERSION]}
ver=${2:-3.12}
mkdir -p "$dir"
for p in cryptography cffi pycparser blake3; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$ver" --implementation cp \
    --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$dir" "$p"
done
ls "$dir"
