#!/usr/bin/env bash
# One-shot GPU check for the Numba CUDA path (no network, < 5 minutes on an H200):
#   1. PTX/SASS compile report (registers, spills) for sm_90,
#   2. the real-GPU tests (pytest -m gpu),
#   3. the kernel microbenchmarks (Numba vs torch SDPA; SDPA rows skip without CUDA torch),
#   4. decode bandwidth as a fraction of device peak (goal >= 0.80 at context >= 2k),
#   5. the host's cost per paged_attention call, and where it goes.
# Usage: benchmarks/gpu_check.sh   (PYTHON=/path/to/python to choose the interpreter)
set -uo pipefail
cd "$(dirname "$0")/.."
if [[ -n "${PYTHON:-}" ]]; then PY="$PYTHON"
elif [[ -x .venv/bin/python ]]; then PY=.venv/bin/python   # the venv `make test` builds
else PY=python3; fi
export PYTHONSAFEPATH=1   # keep the repo root (and its cuda/ dir) off sys.path
status=0
step() { echo; echo "=== $1"; }

step "device"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "nvidia-smi unavailable"

step "PTX / ptxas report (sm_90)"
NUMBA_FORCE_CUDA_CC=9.0 timeout 90 "$PY" -m kvpage.cuda.ptx_check || status=1

step "GPU tests"
timeout 150 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/test_cuda_gpu.py tests/test_gpu_engine.py || status=1

step "microbenchmarks"
timeout 120 "$PY" -m pytest -q -p no:cacheprovider benchmarks/bench_cuda.py --benchmark-only \
    --benchmark-columns=mean,stddev,rounds --benchmark-sort=name \
    --benchmark-json=/tmp/kvpage_bench_cuda.json || status=1
"$PY" - <<'PY' || true
import json
try:
    data = json.load(open("/tmp/kvpage_bench_cuda.json"))
except OSError:
    raise SystemExit(0)
for b in data["benchmarks"]:
    info = b["extra_info"]
    keys = ("backend", "batch", "context", "kv_heads", "block_size", "num_tokens", "kernel_us", "call_us", "gbps",
            "frac_peak", "tflops")
    print(b["name"], {k: round(v, 3) if isinstance(v, float) else v for k, v in info.items() if k in keys})
PY

step "decode bandwidth vs peak"
timeout 90 "$PY" benchmarks/bench_cuda.py || status=1

step "host cost of one paged_attention call"
timeout 60 "$PY" benchmarks/cuda_call_overhead.py || status=1

echo; echo "gpu_check: $([[ $status == 0 ]] && echo OK || echo FAILURES)"
exit $status
