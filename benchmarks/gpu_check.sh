#!/usr/bin/env bash
# One-shot GPU check of the Numba CUDA path on an H100/H200 (no network; every step has a
# timeout, at most 8 minutes in all):
#   1. the device,
#   2. the PTX/ptxas report of every kernel variant for sm_90 (registers, stack, spills, load widths),
#      compiled by 12 processes,
#   3. the real-GPU tests (pytest -m gpu; of tests/test_cuda_quant.py the fast kernel's alone),
#   4. decode: fast vs reference kernel vs torch SDPA, batch 32 x 2k..16k, fp16 and bf16, as a
#      fraction of the device's peak HBM bandwidth; the fast kernel over int8 and fp8 (E4M3)
#      caches at 2k and 8k against fast fp16 and checked against the reference kernel; and the
#      host us of one paged_attention call (benchmarks/gpu_check_report.py: writes
#      gpu_check.json and gpu_check.md),
#   5. where the host time of a paged_attention call goes (cProfile).
# Usage: benchmarks/gpu_check.sh [OUT_DIR]   (default: $OUT, else .; PYTHON=python3 picks the
# interpreter, else .venv/bin/python, else python3). Exits non-zero when any step fails,
# including any kernel output that differs from the reference.
set -uo pipefail
cd "$(dirname "$0")/.."
if [[ -n "${PYTHON:-}" ]]; then PY="$PYTHON"
elif [[ -x .venv/bin/python ]]; then PY=.venv/bin/python   # the venv `make test` builds
else PY=python3; fi
OUT_DIR="${1:-${OUT:-.}}"
mkdir -p "$OUT_DIR"
# Keep the repo root (and its cuda/ dir, which would shadow NVIDIA's `cuda` package) off sys.path.
export PYTHONSAFEPATH=1
if ! "$PY" -c "import kvpage.cuda.ops" 2>/dev/null; then
    # Not installed for this interpreter: stage the installed layout (kvpage/, cuda/ as kvpage.cuda).
    site="$(mktemp -d)"
    cp -r kvpage "$site/"
    ln -s "$PWD/cuda" "$site/kvpage/cuda"
    ln -s "$PWD/adapters" "$site/kvpage/adapters"
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    echo "kvpage is not installed for $PY: using a staged copy in $site"
fi
status=0
step() { echo; echo "=== $1 ($(date +%T))"; }

step "device"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "nvidia-smi unavailable"

step "PTX / ptxas report (sm_90)"
NUMBA_FORCE_CUDA_CC=9.0 timeout 70 "$PY" -m kvpage.cuda.ptx_check --json --jobs 12 > "$OUT_DIR/ptx_report.jsonl" \
    || status=1
"$PY" - "$OUT_DIR/ptx_report.jsonl" <<'PY' || status=1
import json, sys
from kvpage.cuda.ptx_check import format_table
rows = [json.loads(line) for line in open(sys.argv[1]) if line.startswith("{")]
print(rows[0]["skip"] if rows and "skip" in rows[0] else format_table(rows))
PY

step "GPU tests"
timeout 170 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/test_cuda_gpu.py tests/test_cuda_fast.py \
    tests/test_gpu_engine.py "tests/test_cuda_quant.py::test_fast_quantized_decode_on_gpu" || status=1

step "decode: fast vs reference vs SDPA (gpu_check.json, gpu_check.md)"
timeout 190 "$PY" benchmarks/gpu_check_report.py "$OUT_DIR" || status=1

step "host cost of one paged_attention call"
timeout 40 "$PY" benchmarks/cuda_call_overhead.py || status=1

echo; echo "gpu_check: $([[ $status == 0 ]] && echo OK || echo FAILURES) (files in $OUT_DIR)"
exit $status
