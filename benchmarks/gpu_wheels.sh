#!/usr/bin/env bash
# Fetch, on this machine, the wheels benchmarks/gpu_check.sh installs on the GPU machine, which
# reaches no package index: numpy 2.3 for CPython 3.12 (the GPU image's numpy 2.5 is newer than
# its numba-cuda supports: on 2026-12-04 `import numba.cuda` failed there). They land in .whl/
# (git-ignored, about 16 MB); carry that folder with the run and gpu_check.sh installs them
# into a private site folder before anything imports numpy.
# Usage: benchmarks/gpu_wheels.sh [DIR]   (default .whl in the repository root)
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${1:-.whl}"
mkdir -p "$dir"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$dir" "numpy==2.3.5"
ls -l "$dir"
