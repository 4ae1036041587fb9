#!/usr/bin/env bash
# One-shot GPU check of the CUDA path on an H100/H200 (no network; every step has a timeout,
# and the timeouts add up to 8 minutes):
#   1. the device,
#   2. the PTX/ptxas report of every kernel variant for sm_90 (registers, stack, spills, load widths),
#      compiled by 12 processes,
#   3. the real-GPU tests (pytest -m gpu: greedy output against HF with and without CUDA graphs;
#      of tests/test_cuda_quant.py the fast kernel's alone),
#   4. the host time of a 32-layer model's decode step, replayed from a CUDA graph and eager
#      (benchmarks/decode_step_host.py: decode_step_host.json),
#   5. decode: fast vs reference kernel vs torch SDPA, batch 32 x 2k..16k, fp16 and bf16, as a
#      fraction of the device's peak HBM bandwidth; the fast kernel over int8, fp8 (E4M3) and int4
#      caches at 2k and 8k against fast fp16 and checked against the reference kernel; the
#      host us of one paged_attention call; prefill: the Numba kernel against the gather into
#      torch's SDPA (benchmarks/gpu_check_report.py: writes gpu_check.json and gpu_check.md,
#      with step 4's figures),
#   6. end to end: `kvpage bench` A/B/C/D on a random Llama-3-8B (bench_llama3_8b/).
# benchmarks/cuda_call_overhead.py (where a paged_attention call's host time goes) is not
# part of the check: run it by hand when the host time per call needs explaining.
# Usage: benchmarks/gpu_check.sh [OUT_DIR]   (default: $OUT, else .; PYTHON=python3 picks the
# interpreter, else .venv/bin/python, else python3). Wheels in .whl/ (benchmarks/gpu_wheels.sh,
# carried with the run) are installed into a private site folder first. Exits non-zero when any step fails,
# including any kernel output that differs from the reference.
set -uo pipefail
cd "$(dirname "$0")/.."
if [[ -n "${PYTHON:-}" ]]; then PY="$PYTHON"
elif [[ -x .venv/bin/python ]]; then PY=.venv/bin/python   # the venv `make test` builds
else PY=python3; fi
OUT_DIR="${1:-${OUT:-.}}"
mkdir -p "$OUT_DIR"
if compgen -G ".whl/*.whl" > /dev/null; then
    # Wheels carried from benchmarks/gpu_wheels.sh (the GPU machine reaches no package index).
    wheels="$(mktemp -d)"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$wheels" .whl/*.whl \
        && export PYTHONPATH="$wheels${PYTHONPATH:+:$PYTHONPATH}" && echo "using carried wheels: $(ls .whl)"
fi
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
NUMBA_FORCE_CUDA_CC=9.0 timeout 50 "$PY" -m kvpage.cuda.ptx_check --json --jobs 12 > "$OUT_DIR/ptx_report.jsonl" \
    || status=1
"$PY" - "$OUT_DIR/ptx_report.jsonl" <<'PY' || status=1
import json, sys
from kvpage.cuda.ptx_check import format_table
rows = [json.loads(line) for line in open(sys.argv[1]) if line.startswith("{")]
print(rows[0]["skip"] if rows and "skip" in rows[0] else format_table(rows))
PY

step "GPU tests"
timeout 140 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/test_cuda_gpu.py tests/test_cuda_fast.py \
    tests/test_gpu_engine.py "tests/test_cuda_quant.py::test_fast_quantized_decode_on_gpu" || status=1

step "decode: fast vs reference vs SDPA (gpu_check.json, gpu_check.md)"
step "host time of a decode step: CUDA graph replay vs eager (decode_step_host.json)"
timeout 55 "$PY" benchmarks/decode_step_host.py "$OUT_DIR" || status=1

step "decode: fast vs reference vs SDPA; prefill: Numba vs SDPA (gpu_check.json, gpu_check.md)"
timeout 135 "$PY" benchmarks/gpu_check_report.py "$OUT_DIR" || status=1

# --- end to end: the A/B/C/D report on a random bf16 Llama-3-8B (weights built on the GPU, nothing
# downloaded): HF static batching (A), HF continuous batching (B), kvpage paged (C) and paged +
# chunked prefill (D) at one KV budget, 64 ShareGPT-shaped requests at t=0 (scale gpu-check).
# Writes bench.json / bench.md / bench.png under bench_llama3_8b/ (bench.partial.json if cut
# short). tests/test_bench_gpu_config.py runs this bench_args line on CPU with a tiny model.
step "end to end: A/B/C/D, random Llama-3-8B (bench_llama3_8b/)"
bench_args=(--device cuda --dtype bfloat16 --model random-llama3-8b --scenario sharegpt --configs ABCD
            --scale gpu-check --token-budget 512 --no-progress)
bench_dir="$OUT_DIR/bench_llama3_8b"
timeout 95 "$PY" -m kvpage bench "${bench_args[@]}" --out "$bench_dir" || status=1
"$PY" - "$bench_dir" <<'PY' || status=1
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
path = next((p for p in (out / "bench.json", out / "bench.partial.json") if p.exists()), None)
if path is None:
    sys.exit("bench: no report written")
rows = [r for s in json.loads(path.read_text())["scenarios"] for r in s["results"]]
missing = [f"{r['config']} {r['status']}: {r['reason'][:300]}" for r in rows if r["status"] != "ok"]
print(f"bench: {path.name}: {len(rows) - len(missing)} of 4 configurations ran", *missing, sep="\n  ")
sys.exit(1 if missing or len(rows) < 4 else 0)
PY
# --- end of the end-to-end step

echo; echo "gpu_check: $([[ $status == 0 ]] && echo OK || echo FAILURES) (files in $OUT_DIR)"
exit $status
