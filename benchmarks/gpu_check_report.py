"""Decode comparison of ``benchmarks/gpu_check.sh``: fast vs reference Numba kernel vs torch SDPA.

Batch ``BATCH`` x ``CONTEXTS``, 32 query / 8 KV heads (group 4), head_dim 128, block size 16,
shuffled block tables, fp16 and bf16 (bf16 needs CUDA torch; the reference kernel has no bf16).
The KV of every shape is larger than L2, and rotated over copies until the rotation holds at
least ``ROTATION_L2_MULTIPLE`` x the L2 size, so no timed call reads a warm cache. GPU time
comes from CUDA events (``bench_cuda.time_gpu``); bandwidth is K/V bytes read per call over
the peak of ``bench_cuda.PEAK_TABLE`` for the device's name. SDPA reads the same K/V gathered
contiguous (the gather is not timed).

Writes ``gpu_check.json`` and ``gpu_check.md`` into the folder given (else ``$OUT``, else .)::

    {"device": str | null, "date": ISO-8601 UTC, "commit": str | null,
     "host_us_per_decode_step": float | null,   # host us of one paged_attention decode call
     "peak_bytes_per_s": float | null, "peak_source": str | null,
     "rows": [{"batch", "context", "dtype", "kernel": "fast" | "reference", "kernel_us",
               "frac_peak", "sdpa_frac_peak" (null without CUDA torch)}],
     "mismatches": [str], "skipped": [str]}

Without a GPU (or with ``--no-gpu``) nothing is measured: ``device`` and the figures are null
and ``rows`` is empty. Exit status 1 when any output differs from the reference kernel or
SDPA beyond tolerance (after writing the files), else 0.
Usage: ``python benchmarks/gpu_check_report.py [OUT_DIR] [--no-gpu]``.
"""
from __future__ import annotations

import datetime
import itertools
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_cuda, also under PYTHONSAFEPATH=1

BATCH, CONTEXTS = 32, (2048, 4096, 8192, 16384)
HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
ROTATION_L2_MULTIPLE = 4
TOL = {"fp16": dict(rtol=3e-3, atol=2e-3), "bf16": dict(rtol=2e-2, atol=2e-2)}
HOST_CALLS = 200


def base_report(device: str | None) -> dict:
    """The report's fields before anything is measured."""
    return {"device": device, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": _commit(), "host_us_per_decode_step": None, "peak_bytes_per_s": None, "peak_source": None,
            "rows": [], "mismatches": [], "skipped": []}


def _commit() -> str | None:
    if os.environ.get("KVPAGE_COMMIT"):
        return os.environ["KVPAGE_COMMIT"]
    try:
        proc = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parents[1],
                              capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip() or None


def _copies(context: int, l2_bytes: int) -> list[dict]:
    """Decode inputs (CuPy, fp16) in as many copies as the rotation needs."""
    from bench_cuda import kv_bytes, make_decode

    one = kv_bytes(BATCH, context, KV_HEADS, HEAD_DIM, 2)
    count = max(1, math.ceil(ROTATION_L2_MULTIPLE * l2_bytes / one))
    return [make_decode(BATCH, context, HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, seed=i) for i in range(count)]


def _as_bf16(inputs: dict) -> dict:
    """The same inputs as torch tensors, q and the caches rounded to bf16."""
    import torch

    out = {k: torch.as_tensor(v, device="cuda") for k, v in inputs.items()}
    out.update({k: out[k].to(torch.bfloat16) for k in ("q", "key_cache", "value_cache")})
    return out


def _host(x) -> np.ndarray:
    arr = x.get() if hasattr(x, "get") else x.float().cpu().numpy()
    return arr.astype(np.float32).reshape(BATCH, HEADS, HEAD_DIM)


def _rotating(fns: list):
    it = itertools.cycle(fns)
    return lambda: next(it)()


def measure_shape(context: int, dtype: str, peak: float, l2_bytes: int, torch_cuda: bool) -> tuple[list, list]:
    """Rows (fast, and reference for fp16) and mismatch messages for one (context, dtype)."""
    from bench_cuda import kv_bytes, numba_decode_fn, sdpa_decode_fn, time_gpu

    copies = _copies(context, l2_bytes)
    if dtype == "bf16":
        copies = [_as_bf16(c) for c in copies]
    nbytes, mismatches, seconds = kv_bytes(BATCH, context, KV_HEADS, HEAD_DIM, 2), [], {}
    kernels = ("fast", "reference") if dtype == "fp16" else ("fast",)
    outputs = {}
    for kernel in kernels:
        fns = [numba_decode_fn(c, BATCH, context, decode_kernel=kernel) for c in copies]
        outputs[kernel] = _host(fns[0]())
        seconds[kernel] = time_gpu(_rotating(fns))
    if torch_cuda:
        fns = [sdpa_decode_fn(c, BATCH, context) for c in copies]
        outputs["sdpa"] = _host(fns[0]())
        seconds["sdpa"] = time_gpu(_rotating(fns))
    for other in set(outputs) - {"fast"}:
        if not np.allclose(outputs["fast"], outputs[other], **TOL[dtype]):
            err = float(np.abs(outputs["fast"] - outputs[other]).max())
            mismatches.append(f"context {context} {dtype}: fast vs {other} max |diff| {err:.3g}")
    sdpa_frac = round(nbytes / seconds["sdpa"] / peak, 4) if "sdpa" in seconds else None
    rows = [{"batch": BATCH, "context": context, "dtype": dtype, "kernel": k, "kernel_us": round(seconds[k] * 1e6, 2),
             "frac_peak": round(nbytes / seconds[k] / peak, 4), "sdpa_frac_peak": sdpa_frac} for k in kernels]
    return rows, mismatches


def host_us_per_call(fn, calls: int = HOST_CALLS) -> float:
    """Host microseconds per call of ``fn`` while the GPU sleeps (so the host alone is timed)."""
    import cupy
    from bench_cuda import _spin

    fn()
    stream = cupy.cuda.get_current_stream()
    stream.synchronize()
    _spin(stream)
    begin = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - begin
    stream.synchronize()
    return elapsed / calls * 1e6


def measure(report: dict) -> None:
    """Fill ``report`` on the current GPU."""
    import cupy
    from bench_cuda import make_decode, numba_decode_fn, peak_bandwidth

    try:
        import torch
        torch_cuda = torch.cuda.is_available()
    except ImportError:
        torch_cuda = False
    peak, source = peak_bandwidth()
    report.update(peak_bytes_per_s=peak, peak_source=source)
    print(f"peak HBM bandwidth {peak / 1e12:.2f} TB/s from {source}", flush=True)
    l2_bytes = int(cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["l2CacheSize"])
    if not torch_cuda:
        report["skipped"].append("torch without CUDA: no SDPA column and no bf16 rows")
    for dtype in ("fp16", "bf16") if torch_cuda else ("fp16",):
        for context in CONTEXTS:
            rows, mismatches = measure_shape(context, dtype, peak, l2_bytes, torch_cuda)
            report["rows"] += rows
            report["mismatches"] += mismatches
            for row in rows:
                print(json.dumps(row), flush=True)
            cupy.get_default_memory_pool().free_all_blocks()
    fn = numba_decode_fn(make_decode(BATCH, 4096, HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE), BATCH, 4096)
    report["host_us_per_decode_step"] = round(host_us_per_call(fn), 2)


def markdown(report: dict) -> str:
    """The report as Markdown (a header and one table)."""
    def fmt(value):
        return "n/a" if value is None else value

    lines = [f"# gpu_check: {fmt(report['device'])}", "",
             f"date {report['date']}, commit {fmt(report['commit'])}, peak {fmt(report['peak_bytes_per_s'])} B/s "
             f"({fmt(report['peak_source'])}), host us per paged_attention decode call "
             f"{fmt(report['host_us_per_decode_step'])}", "",
             "| batch | context | dtype | kernel | kernel us | frac of peak | SDPA frac of peak |",
             "|---:|---:|---|---|---:|---:|---:|"]
    lines += [f"| {r['batch']} | {r['context']} | {r['dtype']} | {r['kernel']} | {r['kernel_us']} | {r['frac_peak']} "
              f"| {fmt(r['sdpa_frac_peak'])} |" for r in report["rows"]]
    lines += [""] + [f"- MISMATCH: {m}" for m in report["mismatches"]] + [f"- skipped: {s}" for s in report["skipped"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    from kvpage.cuda.interop import gpu_unavailable_reason

    folders = [a for a in argv if not a.startswith("--")]
    out_dir = Path(folders[0] if folders else os.environ.get("OUT") or ".")
    reason = "--no-gpu given" if "--no-gpu" in argv else gpu_unavailable_reason()
    if reason is None:
        from bench_cuda import device_name

        report = base_report(device_name())
        measure(report)
    else:
        print(f"SKIP decode comparison: {reason}")
        report = base_report(None)
        report["skipped"].append(reason)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gpu_check.json").write_text(json.dumps(report, indent=1) + "\n")
    (out_dir / "gpu_check.md").write_text(markdown(report))
    print(markdown(report))
    for message in report["mismatches"]:
        print(f"MISMATCH: {message}", file=sys.stderr)
    return 1 if report["mismatches"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
