"""Compile every kernel to PTX (and, if ``ptxas`` is found, to SASS) without a GPU.

This catches typing/lowering errors that the simulator hides (it runs kernels as plain
Python). Used by ``tests/test_cuda_ptx.py`` and ``benchmarks/gpu_check.sh``::

    NUMBA_FORCE_CUDA_CC=9.0 python -m kvpage.cuda.ptx_check   # prints one line per kernel

Needs libNVVM + libdevice (CUDA toolkit, or the ``nvidia-nvvm``/``nvidia-cuda-nvcc``
wheels); NVRTC is optional (see ``toolchain.ensure_toolchain``).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Optional

from .toolchain import ensure_toolchain


# fp64 arithmetic in a kernel is a performance bug (1/64 rate on consumer parts); loads of
# fp64 launch parameters and their conversion to fp32 are fine.
_FP64_MATH = re.compile(r"\b(?:add|sub|mul|fma|div|ex2|lg2|rcp|sqrt|max|min|setp)\.[a-z0-9.]*f64\b")


@dataclass
class PtxResult:
    """One compiled kernel variant: its PTX, and ptxas' resource line (None without ptxas)."""

    name: str
    ptx: str
    ptxas_info: Optional[str]
    has_fp64: bool


def _signatures():
    """``(name, python function, signature)`` for every kernel variant we ship."""
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
            kern = attention_kernel(rows, d, g, tile, nt)
            sig = (arr(dt, 3), arr(dt, 4), arr(dt, 4), arr(i32, 1), arr(i32, 1), arr(i32, 2),
                   i64, i64, f64, i64, f64, arr(f32, 1), i64, i64, i64, arr(dt, 3),
                   arr(f32, 3), arr(f32, 3), arr(f32, 4))
            out.append((f"attention_{label}_{dt_name}", kern.py_func, sig))
        # (label, head_dim, group, key_tile, max_partition, threads): decode shapes of real models.
        for label, d, g, kt, part, nt in (("g4_d128", 128, 4, 32, 512, 128), ("g8_d128", 128, 8, 32, 512, 128),
                                          ("g1_d64", 64, 1, 32, 512, 128), ("g16_d256", 256, 16, 16, 128, 128)):
            sig = (arr(dt, 3), arr(dt, 4), arr(dt, 4), arr(i32, 1), arr(i32, 1), arr(i32, 2), f64, i64, f64,
                   arr(f32, 1), i64, i64, i64, arr(dt, 3), arr(f32, 3), arr(f32, 3), arr(f32, 4))
            out.append((f"decode_{label}_{dt_name}", decode_kernel(d, g, kt, part, nt).py_func, sig))
        merge = merge_kernel(128, 128)
        out.append((f"merge_d128_{dt_name}", merge.py_func,
                    (arr(f32, 3), arr(f32, 3), arr(f32, 4), i64, arr(f32, 1), i64, i64, arr(dt, 3))))
        out.append((f"store_kv_{dt_name}", store_kernel().py_func,
                    (arr(dt, 4), arr(dt, 4), arr(dt, 3), arr(dt, 3), arr(i64, 1))))
    return out


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


def compile_all(cc: tuple[int, int] = (9, 0)) -> list[PtxResult]:
    """Compile every kernel variant for ``cc``; raises on any compile or assemble error."""
    from numba import cuda

    ensure_toolchain(cc)
    results = []
    for name, func, sig in _signatures():
        ptx, _ = cuda.compile_ptx(func, sig, cc=cc)
        has_fp64 = bool(_FP64_MATH.search(ptx))
        results.append(PtxResult(name, ptx, _ptxas(ptx, cc), has_fp64))
    return results


def main(argv: list[str]) -> int:
    """Print one line per kernel (``--json``: JSON lines; a missing toolkit prints a skip line)."""
    as_json = "--json" in argv
    try:
        ensure_toolchain((9, 0))
    except RuntimeError as exc:
        print(json.dumps({"skip": str(exc)}) if as_json else f"SKIP: {exc}")
        return 0
    for res in compile_all():
        if as_json:
            print(json.dumps({"name": res.name, "ptx_chars": len(res.ptx), "fp64": res.has_fp64,
                              "ptxas": res.ptxas_info, "sm90_target": ".target sm_90" in res.ptx}), flush=True)
        else:
            print(f"{res.name}: ptx {len(res.ptx)} chars, fp64 math={res.has_fp64}, ptxas: {res.ptxas_info}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
