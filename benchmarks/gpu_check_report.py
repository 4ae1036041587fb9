"""Decode comparison of ``benchmarks/gpu_check.sh``: fast vs reference Numba kernel vs torch SDPA,
and the fast kernel over 8-bit quantized KV (int8, fp8 E4M3) vs over fp16 KV.

Batch ``BATCH`` x ``CONTEXTS``, 32 query / 8 KV heads (group 4), head_dim 128, block size 16,
shuffled block tables, fp16 and bf16 (bf16 needs CUDA torch; the reference kernel has no bf16).
The KV of every shape is larger than L2, and rotated over copies until the rotation holds at
least ``ROTATION_L2_MULTIPLE`` x the L2 size, so no timed call reads a warm cache. GPU time
comes from CUDA events (``bench_cuda.time_gpu``); bandwidth is K/V bytes read per call over
the peak of ``bench_cuda.PEAK_TABLE`` for the device's name. SDPA reads the same K/V gathered
contiguous (the gather is not timed).

Quantized rows (``QUANT_FORMATS`` x ``QUANT_CONTEXTS``, same batch and heads, fp16 q): the
caches are uint8 ``[num_blocks, block_bytes]`` buffers of rows quantized by
``kv_quant.quantize_rows``; bytes read count codes and scales (``KVFormat.row_bytes``).
``vs_fast_fp16`` is the fast fp16 kernel's time at the same context over this row's time
(above 1: faster than fp16). The fast kernel's output must match the reference kernel's
over the same bytes within fp16 output rounding (``TOL["fp16"]``).

Writes ``gpu_check.json`` and ``gpu_check.md`` into the folder given (else ``$OUT``, else .)::

    {"device": str | null, "date": ISO-8601 UTC, "commit": str | null,
     "host_us_per_decode_step": float | null,   # host us of one paged_attention decode call
     "peak_bytes_per_s": float | null, "peak_source": str | null,
     "rows": [{"batch", "context", "dtype" (fp16 | bf16 | int8 | fp8_e4m3), "kernel": "fast" | "reference",
               "kernel_us", "frac_peak", "sdpa_frac_peak" (null without CUDA torch; null for 8-bit),
               "vs_fast_fp16" (8-bit rows only)}],
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
QUANT_FORMATS, QUANT_CONTEXTS = ("int8", "fp8_e4m3"), (2048, 8192)
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


def _quant_buffer(name: str, context: int, seed: int = 0) -> tuple:
    """A host uint8 ``[num_blocks, block_bytes]`` cache of ``BATCH`` x ``context`` tokens:
    4096 rows quantized by the numpy reference, repeated (codes and scales stay paired)."""
    from kvpage.core.kv_formats import CacheFormat, KVFormat
    from kvpage.kernels import kv_quant

    fmt = KVFormat(name)
    rows = np.random.default_rng(seed).standard_normal((4096, HEAD_DIM)).astype(np.float32)
    codes, scales = kv_quant.quantize_rows(rows, fmt)
    num_blocks = BATCH * -(-context // BLOCK_SIZE)
    per_block = BLOCK_SIZE * KV_HEADS
    buf = np.concatenate([np.resize(codes.reshape(-1), (num_blocks, per_block * codes.shape[1])),
                          np.resize(scales.reshape(-1), (num_blocks, per_block * scales.shape[1]))], axis=1)
    assert buf.shape == fmt.buffer_shape(num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    return buf, CacheFormat(fmt, BLOCK_SIZE)


def _quant_copies(name: str, context: int, l2_bytes: int) -> tuple[list[dict], int]:
    """Decode inputs over ``name`` caches (CuPy) in as many copies as the rotation needs, and
    the bytes one call reads."""
    import cupy

    key, cf = _quant_buffer(name, context, seed=1)
    value, _ = _quant_buffer(name, context, seed=2)
    nbytes = 2 * BATCH * context * KV_HEADS * cf.kv_format.row_bytes(HEAD_DIM)
    copies = []
    for i in range(max(1, math.ceil(ROTATION_L2_MULTIPLE * l2_bytes / nbytes))):
        rng = np.random.default_rng(100 + i)
        tables = rng.permutation(key.shape[0]).astype(np.int32).reshape(BATCH, -1)
        q = rng.standard_normal((BATCH, HEADS, HEAD_DIM)).astype(np.float16)
        copies.append(dict(q=cupy.asarray(q), key_cache=cupy.asarray(key), value_cache=cupy.asarray(value),
                           query_start_loc=cupy.asarray(np.arange(BATCH + 1, dtype=np.int32)),
                           seq_lens=cupy.asarray(np.full(BATCH, context, np.int32)),
                           block_tables=cupy.asarray(tables), cache_format=cf))
    return copies, nbytes


def measure_quant_shape(name: str, context: int, peak: float, l2_bytes: int, fp16_seconds) -> tuple[list, list]:
    """Rows (fast, reference) and mismatch messages for one 8-bit format and context;
    ``fp16_seconds``: the fast fp16 kernel's time at this context (None if not measured)."""
    from bench_cuda import numba_decode_fn, time_gpu

    copies, nbytes = _quant_copies(name, context, l2_bytes)
    outputs, rows = {}, []
    for kernel in ("fast", "reference"):
        fns = [numba_decode_fn(c, BATCH, context, decode_kernel=kernel) for c in copies]
        outputs[kernel] = _host(fns[0]())
        seconds = time_gpu(_rotating(fns))
        rows.append({"batch": BATCH, "context": context, "dtype": name, "kernel": kernel,
                     "kernel_us": round(seconds * 1e6, 2), "frac_peak": round(nbytes / seconds / peak, 4),
                     "sdpa_frac_peak": None,
                     "vs_fast_fp16": round(fp16_seconds / seconds, 3) if fp16_seconds else None})
    mismatches = []
    if not np.allclose(outputs["fast"], outputs["reference"], **TOL["fp16"]):
        err = float(np.abs(outputs["fast"] - outputs["reference"]).max())
        mismatches.append(f"context {context} {name}: fast vs reference max |diff| {err:.3g}")
    return rows, mismatches


def measure_quant(report: dict, peak: float, l2_bytes: int) -> None:
    """The 8-bit rows of ``report`` (after the fp16 ones, whose fast times they compare with)."""
    import cupy

    fp16 = {r["context"]: r["kernel_us"] / 1e6 for r in report["rows"]
            if r["dtype"] == "fp16" and r["kernel"] == "fast"}
    for name in QUANT_FORMATS:
        for context in QUANT_CONTEXTS:
            try:
                rows, mismatches = measure_quant_shape(name, context, peak, l2_bytes, fp16.get(context))
            except Exception as exc:  # noqa: BLE001 - reported as a failure, the other rows still run
                rows, mismatches = [], [f"context {context} {name}: {type(exc).__name__}: {exc}"]
            report["rows"] += rows
            report["mismatches"] += mismatches
            for row in rows:
                print(json.dumps(row), flush=True)
            cupy.get_default_memory_pool().free_all_blocks()


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
    measure_quant(report, peak, l2_bytes)
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
             "| batch | context | dtype | kernel | kernel us | frac of peak | SDPA frac of peak | vs fast fp16 |",
             "|---:|---:|---|---|---:|---:|---:|---:|"]
    lines += [f"| {r['batch']} | {r['context']} | {r['dtype']} | {r['kernel']} | {r['kernel_us']} | {r['frac_peak']} "
              f"| {fmt(r['sdpa_frac_peak'])} | {fmt(r.get('vs_fast_fp16'))} |" for r in report["rows"]]
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
