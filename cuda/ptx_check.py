"""Compile every kernel variant to PTX (and, if ``ptxas`` is found, to SASS) without a GPU.

This catches typing/lowering errors that the simulator hides (it runs kernels as plain
Python), and reports what decides a kernel's speed: its global load widths, registers,
stack, spills and shared memory. Used by ``tests/test_cuda_ptx.py`` and ``benchmarks/gpu_check.sh``::

    NUMBA_FORCE_CUDA_CC=9.0 python -m kvpage.cuda.ptx_check [--json] [--fast] [--only NAME,...] [--jobs N]

``--json`` prints one object per variant (``PtxResult.row``), else a table; ``--fast``
keeps the fast decode variants only; ``--jobs N`` compiles in N processes (same output, in
the same order). The variants: the reference kernels (fp16/fp32), the quantized-cache
store/decode/prefill kernels (``quant_variant_names``) and the fast decode ones
(``fast_variant_names``: fp16/bf16, then int8 and fp8 caches).
Needs libNVVM + libdevice (CUDA toolkit, or the ``nvidia-nvvm``/``nvidia-cuda-nvcc`` wheels);
NVRTC is optional (``toolchain.ensure_toolchain``).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Callable, Optional

from .toolchain import ensure_toolchain

# fp64 arithmetic in a kernel is a performance bug (1/64 rate on consumer parts); loads of
# fp64 launch parameters and their conversion to fp32 are fine.
_FP64_MATH = re.compile(r"\b(?:add|sub|mul|fma|div|ex2|lg2|rcp|sqrt|max|min|setp)\.[a-z0-9.]*f64\b")
_LD_GLOBAL = re.compile(r"\bld\.global((?:\.[a-z0-9]+)*)\s")
_PTXAS_NUMBERS = {"registers": r"Used (\d+) registers", "stack_bytes": r"(\d+) bytes stack frame",
                  "spill_bytes": r"(\d+) bytes spill stores", "smem_bytes": r"(\d+) bytes smem"}


@dataclass(frozen=True, slots=True)
class Variant:
    """One compiled kernel: its report name, Python function and Numba signature; ``shape``
    holds a fast variant's ``head_dim``/``group``/``kv_dtype`` (empty for the others)."""

    name: str
    func: Callable
    signature: tuple
    shape: dict


@dataclass(frozen=True, slots=True)
class PtxResult:
    """One compiled variant: its PTX, ptxas' resource line (None without ptxas), and the
    seconds both took."""

    variant: Variant
    ptx: str
    ptxas_info: Optional[str]
    seconds: float = 0.0

    def row(self) -> dict:
        """The JSON report: ``name``, ``fast``, ``sm90_target``, ``ptx_chars``, ``fp64`` (fp64
        arithmetic present), ``global_loads`` (load width in bits -> count), ``seconds``,
        ``ptxas`` and its ``registers``/``stack_bytes``/``spill_bytes``/``smem_bytes`` (None
        without ptxas); a fast variant adds its ``head_dim``, ``group``, ``kv_dtype``, ``unroll``."""
        row = {"name": self.variant.name, "fast": bool(self.variant.shape), **self.variant.shape,
               "sm90_target": ".target sm_90" in self.ptx, "ptx_chars": len(self.ptx),
               "fp64": bool(_FP64_MATH.search(self.ptx)), "global_loads": global_loads(self.ptx),
               "seconds": round(self.seconds, 2), "ptxas": self.ptxas_info}
        for key, pattern in _PTXAS_NUMBERS.items():
            found = re.search(pattern, self.ptxas_info or "")
            row[key] = int(found.group(1)) if found else None
        return row


def global_loads(ptx: str) -> dict[str, int]:
    """Count of ``ld.global`` instructions per load width in bits (vector width x element bits)."""
    counts: dict[str, int] = {}
    for match in _LD_GLOBAL.finditer(ptx):
        mods = match.group(1).split(".")[1:]
        vec = next((int(m[1:]) for m in mods if re.fullmatch(r"v\d", m)), 1)
        bits = next(int(m[1:]) for m in reversed(mods) if re.fullmatch(r"[usbf]\d+", m))
        key = str(vec * bits)
        counts[key] = counts.get(key, 0) + 1
    return counts


def _reference_variants() -> list[Variant]:
    """The reference attention, decode, merge and store kernels at real models' shapes."""
    from numba.cuda import types as T

    from .attention_kernels import attention_kernel, merge_kernel
    from .decode_kernels import decode_kernel
    from .store_kernels import store_kernel

    def arr(dtype, ndim):
        return T.Array(dtype, ndim, "C")

    i32, i64, f32, f64 = T.int32, T.int64, T.float32, T.float64
    out = []
    for dt_name, dt in (("fp16", T.float16), ("fp32", T.float32)):
        # (label, rows, head_dim, group, tile, threads): decode and prefill shapes of real models.
        for label, rows, d, g, tile, nt in (("rows8_g8_d128", 8, 128, 8, 32, 128),
                                            ("prefill_g4_d128", 16, 128, 4, 16, 128)):
            sig = (arr(dt, 3), arr(dt, 4), arr(dt, 4), arr(i32, 1), arr(i32, 1), arr(i32, 2),
                   i64, i64, f64, i64, f64, arr(f32, 1), i64, i64, i64, arr(dt, 3),
                   arr(f32, 3), arr(f32, 3), arr(f32, 4))
            out.append(Variant(f"attention_{label}_{dt_name}", attention_kernel(rows, d, g, tile, nt).py_func, sig, {}))
        # (label, head_dim, group, key_tile, max_partition, threads): decode shapes of real models.
        for label, d, g, kt, part, nt in (("g4_d128", 128, 4, 32, 512, 128), ("g8_d128", 128, 8, 32, 512, 128),
                                          ("g1_d64", 64, 1, 32, 512, 128), ("g16_d256", 256, 16, 16, 128, 128)):
            sig = (arr(dt, 3), arr(dt, 4), arr(dt, 4), arr(i32, 1), arr(i32, 1), arr(i32, 2), f64, i64, f64,
                   arr(f32, 1), i64, i64, i64, arr(dt, 3), arr(f32, 3), arr(f32, 3), arr(f32, 4))
            out.append(Variant(f"decode_{label}_{dt_name}", decode_kernel(d, g, kt, part, nt).py_func, sig, {}))
        out.append(Variant(f"merge_d128_{dt_name}", merge_kernel(128, 128).py_func,
                           (arr(f32, 3), arr(f32, 3), arr(f32, 4), i64, arr(f32, 1), i64, i64, arr(dt, 3)), {}))
        out.append(Variant(f"store_kv_{dt_name}", store_kernel().py_func,
                           (arr(dt, 4), arr(dt, 4), arr(dt, 3), arr(dt, 3), arr(i64, 1)), {}))
    return out


#: The quantized KV formats whose store and reference attention kernels are compiled.
QUANT_FORMATS = ("fp8_e4m3", "fp8_e5m2", "int8", "int4")


def quant_variant_names() -> list[str]:
    """Names of the quantized-cache variants (``_quant_variants``)."""
    return [f"{kind}_{fmt}" for fmt in QUANT_FORMATS
            for kind in ("store_kv_fp16", "decode_g4_d128_fp16", "attention_prefill_g4_d128_fp16")]


def _quant_variants() -> list[Variant]:
    """Store, decode and prefill kernels over uint8 caches ``[num_blocks, block_bytes]`` of each
    quantized format (fp16 q and rows), at a real model's shape."""
    from numba.cuda import types as T

    from .attention_kernels import attention_kernel
    from .decode_kernels import decode_kernel
    from .quant_store import quant_store_kernel

    def arr(dtype, ndim):
        return T.Array(dtype, ndim, "C")

    i32, i64, f32, f64, f16, u8 = T.int32, T.int64, T.float32, T.float64, T.float16, T.uint8
    parts = (arr(f32, 3), arr(f32, 3), arr(f32, 4))
    meta = (arr(i32, 1), arr(i32, 1), arr(i32, 2))
    out = []
    for fmt in QUANT_FORMATS:
        store = (arr(u8, 2), arr(u8, 2), arr(f16, 3), arr(f16, 3), arr(i64, 1), i64)
        decode = (arr(f16, 3), arr(u8, 2), arr(u8, 2), *meta, f64, i64, f64, arr(f32, 1), i64, i64, i64,
                  arr(f16, 3), *parts)
        prefill = (arr(f16, 3), arr(u8, 2), arr(u8, 2), *meta, i64, i64, f64, i64, f64, arr(f32, 1), i64, i64, i64,
                   arr(f16, 3), *parts)
        out += [Variant(f"store_kv_fp16_{fmt}", quant_store_kernel(fmt, 128).py_func, store, {}),
                Variant(f"decode_g4_d128_fp16_{fmt}", decode_kernel(128, 4, 32, 512, 128, fmt).py_func, decode, {}),
                Variant(f"attention_prefill_g4_d128_fp16_{fmt}", attention_kernel(16, 128, 4, 16, 128, fmt).py_func,
                        prefill, {})]
    return out


def fast_variant_name(head_dim: int, group: int, kv_dtype: str) -> str:
    return f"fast_decode_d{head_dim}_g{group}_{kv_dtype}"


def fast_variant_names() -> list[str]:
    """Names of every fast decode variant: 16-bit, then 8-bit quantized KV (no numba import)."""
    from .fast_launch import FAST_GROUPS, FAST_HEAD_DIMS, FAST_KV_DTYPES, FAST_QUANT_DTYPES

    return [fast_variant_name(d, g, dt) for dt in FAST_KV_DTYPES + FAST_QUANT_DTYPES
            for d in FAST_HEAD_DIMS for g in FAST_GROUPS]


def _fast_variants() -> list[Variant]:
    """Every compiled ``(head_dim, group, kv_dtype)`` of the fast decode kernel; ``shape`` also
    holds ``unroll`` (warp steps per iteration: one K and one V row load each)."""
    from .decode_fast import fast_decode_kernel, fast_signature
    from .fast_launch import FAST_GROUPS, FAST_HEAD_DIMS, FAST_KV_DTYPES, FAST_QUANT_DTYPES, fast_unroll

    return [Variant(fast_variant_name(d, g, dt), fast_decode_kernel(d, g, dt).py_func, fast_signature(dt),
                    {"head_dim": d, "group": g, "kv_dtype": dt, "unroll": fast_unroll(g, dt)})
            for dt in FAST_KV_DTYPES + FAST_QUANT_DTYPES for d in FAST_HEAD_DIMS for g in FAST_GROUPS]


def _ptxas(ptx: str, cc: tuple[int, int]) -> Optional[str]:
    """Assemble with ptxas when available; returns its -v resource summary. Raises on errors."""
    exe = shutil.which("ptxas") or next(
        (p for p in (os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "ptxas"),) if os.path.exists(p)),
        None)
    if exe is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as fh:
            fh.write(ptx)
        proc = subprocess.run([exe, "-v", f"-arch=sm_{cc[0]}{cc[1]}", src, "-o", os.path.join(tmp, "k.cubin")],
                              capture_output=True, text=True, timeout=120)
    if proc.returncode:
        raise RuntimeError(f"ptxas failed:\n{proc.stderr}")
    lines = [ln.split("info    : ")[-1] for ln in proc.stderr.splitlines() if "Used" in ln or "spill" in ln]
    return "; ".join(lines)


def compile_all(cc: tuple[int, int] = (9, 0), fast_only: bool = False,
                only: Optional[set[str]] = None, echo: bool = False) -> list[PtxResult]:
    """Compile the variants for ``cc`` (``only``: those names); raises on any compile or assemble
    error. ``echo``: print each variant's JSON row as soon as it is done."""
    from numba import cuda

    ensure_toolchain(cc)
    variants = _fast_variants() if fast_only else _reference_variants() + _quant_variants() + _fast_variants()
    results = []
    for variant in variants:
        if only is None or variant.name in only:  # (building a variant's dispatcher compiles nothing)
            start = time.perf_counter()
            ptx, _ = cuda.compile_ptx(variant.func, variant.signature, cc=cc)
            info = _ptxas(ptx, cc)
            results.append(PtxResult(variant, ptx, info, time.perf_counter() - start))
            if echo:
                print(json.dumps(results[-1].row()), flush=True)
    return results


def format_table(rows: list[dict]) -> str:
    """The report as a fixed-width table, one line per variant."""
    head = f"{'variant':<34} {'regs':>5} {'stack':>6} {'spill':>6} {'smem':>6} {'fp64':>5}  global loads (bits: count)"
    lines = [head]
    for r in rows:
        loads = ", ".join(f"{k}: {v}" for k, v in sorted(r["global_loads"].items(), key=lambda kv: int(kv[0])))
        lines.append(f"{r['name']:<34} {r['registers'] if r['registers'] is not None else '-':>5} "
                     f"{r['stack_bytes'] if r['stack_bytes'] is not None else '-':>6} "
                     f"{r['spill_bytes'] if r['spill_bytes'] is not None else '-':>6} "
                     f"{r['smem_bytes'] if r['smem_bytes'] is not None else '-':>6} {str(r['fp64']):>5}  {loads}")
    return "\n".join(lines)


def _parallel_rows(names: list[str], jobs: int) -> list[dict]:
    """The rows of ``names``, compiled by ``jobs`` child processes (``--only`` each), in order."""
    chunks = [names[i::jobs] for i in range(jobs) if names[i::jobs]]
    flags = ["-P"] if sys.flags.safe_path else []
    procs = [subprocess.Popen([sys.executable, *flags, "-m", "kvpage.cuda.ptx_check", "--json", "--only",
                               ",".join(chunk)], stdout=subprocess.PIPE, text=True) for chunk in chunks]
    found = {}
    for proc in procs:
        out, _ = proc.communicate()
        if proc.returncode:
            raise RuntimeError(f"a ptx_check job exited {proc.returncode}")
        rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        found.update((row["name"], row) for row in rows)
    return [found[name] for name in names]


def main(argv: list[str]) -> int:
    """Print the report (see the module docstring); a missing toolkit prints a skip line."""
    as_json = "--json" in argv
    try:
        ensure_toolchain((9, 0))
    except RuntimeError as exc:
        print(json.dumps({"skip": str(exc)}) if as_json else f"SKIP: {exc}")
        return 0
    only = set(argv[argv.index("--only") + 1].split(",")) if "--only" in argv else None
    jobs = int(argv[argv.index("--jobs") + 1]) if "--jobs" in argv else 1
    if jobs > 1:
        fast = _fast_variants()
        variants = fast if "--fast" in argv else _reference_variants() + _quant_variants() + fast
        rows = _parallel_rows([v.name for v in variants if only is None or v.name in only], jobs)
    else:
        rows = [res.row() for res in compile_all(fast_only="--fast" in argv, only=only, echo=as_json)]
    if as_json and jobs > 1:
        for row in rows:
            print(json.dumps(row), flush=True)
    if not as_json:
        print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
