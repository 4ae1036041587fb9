"""Decode comparison of ``benchmarks/gpu_check.sh``: fast vs reference Numba kernel vs torch SDPA,
and the fast kernel over quantized KV (int8, fp8 E4M3, int4) vs over fp16 KV.

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

Prefill rows (``PREFILL_SEQS`` sequences with a ``PREFILL_CONTEXT``-token context each, same
heads and block size, CUDA torch needed): ``prompt`` (the whole context is the query) and
``chunk`` (the last ``PREFILL_CHUNK`` tokens, after earlier context). The Numba prefill
kernel (fp16; it has no bf16) against the gather into torch's SDPA
(``kvpage.attention.gather_sdpa``, fp16 and bf16), per call of one layer: the SDPA plan is
built once per step, so it is not timed. Inputs are bf16-representable values, so every
output must match the Numba fp16 one within its dtype's ``TOL``; ``tflops`` counts the
causal score and value products (4 x heads x head_dim per visible key).

Writes ``gpu_check.json`` and ``gpu_check.md`` into the folder given (else ``$OUT``, else .)::

    {"device": str | null, "date": ISO-8601 UTC, "commit": str | null,
     "host_us_per_decode_step": float | null,   # host us of a 32-layer decode step replayed from a CUDA graph
     "eager_host_us_per_decode_step": float | null,   # the same step launched eagerly
     "host_us_per_attention_call": float | null,   # host us of one eager paged_attention decode call
     "peak_bytes_per_s": float | null, "peak_source": str | null,
     "rows": [{"batch", "context", "dtype" (fp16 | bf16 | int8 | fp8_e4m3 | int4), "kernel": "fast" | "reference",
               "kernel_us", "frac_peak", "sdpa_frac_peak" (null without CUDA torch; null for 8-bit),
               "vs_fast_fp16" (8-bit rows only)}],
     "prefill_rows": [{"shape": "prompt" | "chunk", "seqs", "query_len", "context",
                       "dtype" (fp16 | bf16), "kernel": "numba" | "sdpa", "ms", "tflops"}],
     "mismatches": [str], "skipped": [str]}

Without a GPU (or with ``--no-gpu``) nothing is measured: ``device`` and the figures are null
and ``rows`` and ``prefill_rows`` are empty. Exit status 1 when any output differs from the
reference kernel or SDPA (or a prefill output from the Numba one) beyond tolerance, or a
prefill comparison fails to run (after writing the files), else 0.
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
QUANT_FORMATS, QUANT_CONTEXTS = ("int8", "fp8_e4m3", "int4"), (2048, 8192)
HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
ROTATION_L2_MULTIPLE = 4
TOL = {"fp16": dict(rtol=3e-3, atol=2e-3), "bf16": dict(rtol=2e-2, atol=2e-2)}
HOST_CALLS = 200
PREFILL_SEQS, PREFILL_CONTEXT, PREFILL_CHUNK = 4, 2048, 512
#: Query tokens per sequence of each prefill shape.
PREFILL_SHAPES = {"prompt": PREFILL_CONTEXT, "chunk": PREFILL_CHUNK}
#: Seconds of timed calls per (shape, dtype, kernel) at most (one call when a call is longer).
PREFILL_TIMED_S = 1.0


def base_report(device: str | None) -> dict:
    """The report's fields before anything is measured."""
    return {"device": device, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": _commit(), "host_us_per_decode_step": None,
            "eager_host_us_per_decode_step": None, "host_us_per_attention_call": None, "peak_bytes_per_s": None, "peak_source": None,
            "rows": [], "prefill_rows": [], "mismatches": [], "skipped": []}


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
            _add_rows(report, "rows", *_guarded(f"context {context} {name}", lambda: measure_quant_shape(
                name, context, peak, l2_bytes, fp16.get(context))))
            cupy.get_default_memory_pool().free_all_blocks()


def _guarded(label: str, measure) -> tuple[list, list]:
    """``measure()``'s ``(rows, mismatches)``, or no rows and one mismatch naming ``label``
    and the exception: a failure is reported, and the other rows still run."""
    try:
        return measure()
    except Exception as exc:  # noqa: BLE001 - reported as a failure
        return [], [f"{label}: {type(exc).__name__}: {exc}"]


def _add_rows(report: dict, key: str, rows: list, mismatches: list) -> None:
    """Append ``rows`` to ``report[key]`` and ``mismatches`` to its mismatches; print the rows."""
    report[key] += rows
    report["mismatches"] += mismatches
    for row in rows:
        print(json.dumps(row), flush=True)


def _prefill_case(q_len: int, seed: int = 0) -> dict:
    """CUDA float32 inputs of ``PREFILL_SEQS`` sequences, each ``q_len`` query tokens ending a
    ``PREFILL_CONTEXT``-token context (shuffled block tables, host metadata as a step has it).
    Values are rounded to bf16 first, so fp16 and bf16 copies hold the same numbers."""
    import torch

    rng = np.random.default_rng(seed)
    per_seq = PREFILL_CONTEXT // BLOCK_SIZE
    tables = rng.permutation(PREFILL_SEQS * per_seq).astype(np.int32).reshape(PREFILL_SEQS, per_seq)
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def values(shape):
        return torch.randn(shape, generator=gen, device="cuda").to(torch.bfloat16).float()

    cache_shape = (PREFILL_SEQS * per_seq, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    return dict(q=values((PREFILL_SEQS * q_len, HEADS, HEAD_DIM)), key_cache=values(cache_shape),
                value_cache=values(cache_shape), query_start_loc=np.arange(PREFILL_SEQS + 1, dtype=np.int32) * q_len,
                seq_lens=np.full(PREFILL_SEQS, PREFILL_CONTEXT, np.int32), block_tables=tables)


def _prefill_fns(case: dict, dtype: str) -> dict:
    """The calls of one layer's prefill in ``dtype``: ``sdpa`` always, ``numba`` for fp16."""
    import torch

    from kvpage.attention.gather_sdpa import plan_prefill, run_prefill_plan
    from kvpage.cuda import paged_attention

    q, kc, vc = (case[k].to({"fp16": torch.float16, "bf16": torch.bfloat16}[dtype])
                 for k in ("q", "key_cache", "value_cache"))
    qsl, lens, tables = case["query_start_loc"], case["seq_lens"], case["block_tables"]
    scaling = 1.0 / math.sqrt(HEAD_DIM)
    plan = plan_prefill(qsl, lens, tables, BLOCK_SIZE, 0, q.device)  # once per step: not timed
    fns = {"sdpa": lambda: run_prefill_plan(plan, q, kc, vc, scaling)}
    if dtype == "fp16":
        meta = [torch.as_tensor(a, device="cuda") for a in (qsl, lens, tables)]
        fns["numba"] = lambda: paged_attention(q, kc, vc, *meta, scaling, num_decodes=0,
                                               max_prefill_query_len=int(qsl[1]), max_seq_len=PREFILL_CONTEXT)
    return fns


def _time_prefill(fn) -> float:
    """GPU seconds per call (``bench_cuda.time_gpu``), repeats sized to ``PREFILL_TIMED_S``."""
    import torch
    from bench_cuda import time_gpu

    fn()  # compiles a Numba kernel on its first call
    torch.cuda.synchronize()
    begin = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    once = time.perf_counter() - begin
    return time_gpu(fn, repeats=max(1, min(10, int(PREFILL_TIMED_S / max(once, 1e-4)))))


def _prefill_flops(q_len: int) -> float:
    """Multiply-adds x 2 of the scores and the values over every visible key of one call."""
    visible = q_len * (PREFILL_CONTEXT - q_len) + q_len * (q_len + 1) // 2  # keys seen, summed over rows
    return 4.0 * HEADS * HEAD_DIM * visible * PREFILL_SEQS


def measure_prefill_shape(shape: str, q_len: int) -> tuple[list, list]:
    """Rows (numba fp16, sdpa fp16, sdpa bf16) and mismatch messages for one prefill shape."""
    import torch

    case = _prefill_case(q_len)
    outputs, rows = {}, []
    for dtype in ("fp16", "bf16"):
        for kernel, fn in _prefill_fns(case, dtype).items():
            outputs[(kernel, dtype)] = fn().float()
            seconds = _time_prefill(fn)
            rows.append({"shape": shape, "seqs": PREFILL_SEQS, "query_len": q_len, "context": PREFILL_CONTEXT,
                         "dtype": dtype, "kernel": kernel, "ms": round(seconds * 1e3, 3),
                         "tflops": round(_prefill_flops(q_len) / seconds / 1e12, 2)})
    want, mismatches = outputs[("numba", "fp16")], []
    for (kernel, dtype), got in outputs.items():
        if not torch.allclose(got, want, **TOL[dtype]):
            err = float((got - want).abs().max())
            mismatches.append(f"prefill {shape} {dtype}: {kernel} vs numba fp16 max |diff| {err:.3g}")
    return rows, mismatches


def measure_prefill(report: dict, torch_cuda: bool) -> None:
    """The prefill rows of ``report``; a failure is reported and the rest of the check goes on."""
    if not torch_cuda:
        report["skipped"].append("torch without CUDA: no prefill comparison")
        return
    import torch

    for shape, q_len in PREFILL_SHAPES.items():
        _add_rows(report, "prefill_rows", *_guarded(f"prefill {shape}", lambda: measure_prefill_shape(shape, q_len)))
        torch.cuda.empty_cache()


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
            _add_rows(report, "rows", *measure_shape(context, dtype, peak, l2_bytes, torch_cuda))
            cupy.get_default_memory_pool().free_all_blocks()
    measure_quant(report, peak, l2_bytes)
    fn = numba_decode_fn(make_decode(BATCH, 4096, HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE), BATCH, 4096)
    report["host_us_per_attention_call"] = round(host_us_per_call(fn), 2)
    measure_prefill(report, torch_cuda)


def markdown(report: dict) -> str:
    """The report as Markdown (a header and one table)."""
    def fmt(value):
        return "n/a" if value is None else value

    lines = [f"# gpu_check: {fmt(report['device'])}", "",
             f"date {report['date']}, commit {fmt(report['commit'])}, peak {fmt(report['peak_bytes_per_s'])} B/s "
             f"({fmt(report['peak_source'])})", "",
             f"host us per decode step of a 32-layer model: {fmt(report['host_us_per_decode_step'])} replayed from "
             f"a CUDA graph, {fmt(report.get('eager_host_us_per_decode_step'))} eager; per eager paged_attention "
             f"decode call: {fmt(report.get('host_us_per_attention_call'))}", "",
             "| batch | context | dtype | kernel | kernel us | frac of peak | SDPA frac of peak | vs fast fp16 |",
             "|---:|---:|---|---|---:|---:|---:|---:|"]
    lines += [f"| {r['batch']} | {r['context']} | {r['dtype']} | {r['kernel']} | {r['kernel_us']} | {r['frac_peak']} "
              f"| {fmt(r['sdpa_frac_peak'])} | {fmt(r.get('vs_fast_fp16'))} |" for r in report["rows"]]
    prefill = report.get("prefill_rows") or []
    if prefill:
        lines += ["", "| prefill | seqs | query len | context | dtype | kernel | ms | TFLOP/s |",
                  "|---|---:|---:|---:|---|---|---:|---:|"]
        lines += [f"| {r['shape']} | {r['seqs']} | {r['query_len']} | {r['context']} | {r['dtype']} | {r['kernel']} "
                  f"| {r['ms']} | {r['tflops']} |" for r in prefill]
    lines += [""] + [f"- MISMATCH: {m}" for m in report["mismatches"]] + [f"- skipped: {s}" for s in report["skipped"]]
    return "\n".join(lines) + "\n"


def add_step_host_times(report: dict, out_dir: Path) -> None:
    """Copy the decode step's host times from ``decode_step_host.json`` (written into the
    same folder by ``benchmarks/decode_step_host.py``, which ``gpu_check.sh`` runs first)."""
    path = out_dir / "decode_step_host.json"
    if not path.exists():
        report["skipped"].append("no decode_step_host.json: the decode step's host time is unmeasured")
        return
    measured = json.loads(path.read_text())
    for key in ("host_us_per_decode_step", "eager_host_us_per_decode_step"):
        report[key] = measured.get(key)


def main(argv: list[str]) -> int:
    from kvpage.cuda.interop import gpu_unavailable_reason

    folders = [a for a in argv if not a.startswith("--")]
    out_dir = Path(folders[0] if folders else os.environ.get("OUT") or ".")
    reason = "--no-gpu given" if "--no-gpu" in argv else gpu_unavailable_reason()
    if reason is None:
        from bench_cuda import device_name

        report = base_report(device_name())
        measure(report)
        add_step_host_times(report, out_dir)
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
