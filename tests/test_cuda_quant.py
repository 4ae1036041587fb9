"""Quantized KV caches in the Numba CUDA kernels (``kvpage.cuda`` with ``cache_format``).

* Simulator (``cuda_quant_cases.py``, two subprocesses with ``NUMBA_ENABLE_CUDASIM=1``): per
  quantized format, ``store_kv`` writes exactly ``kv_quant.quantize_rows``' bytes, and decode,
  prefill and a mixed step match the numpy oracle on the dequantized cache (the tolerances
  are argued in that module's docstring).
* PTX (one subprocess, no simulator): the quantized store, decode and prefill variants compile
  for sm_90 (typing and lowering errors the simulator hides), with no fp64 arithmetic, no
  spills, and the store and decode kernels without a stack frame.
* Here: the launch-side checks that need no kernel.
* Real GPU (``gpu`` marker, skipped without CuPy and a device): the same checks with CuPy
  arrays at a real model's shapes (head_dim 128, block_size 16, GQA 4, contexts up to ~2k).
"""
from __future__ import annotations

import importlib.util
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from _cuda_subprocess import TESTS_DIR, run_json_lines
from kvpage.cuda.interop import gpu_unavailable_reason

pytest.importorskip("numba")


def _cases_module():
    spec = importlib.util.spec_from_file_location("cuda_quant_cases", TESTS_DIR / "cuda_quant_cases.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)  # imports numpy only: kernels load inside the cases
    return module


CASES = _cases_module()
CASE_NAMES = list(CASES.CASES)


def _quant_variant_names() -> list[str]:
    from kvpage.cuda.ptx_check import quant_variant_names  # no numba at import

    return quant_variant_names()


def _simulate(names: list[str]) -> list[dict]:
    return run_json_lines(["cuda_quant_cases.py", *names], {"NUMBA_ENABLE_CUDASIM": "1"}, timeout=300)


def _compile(names: list[str]) -> list[dict]:
    return run_json_lines(["-m", "kvpage.cuda.ptx_check", "--json", "--only", ",".join(names)],
                          {"NUMBA_FORCE_CUDA_CC": "9.0", "NUMBA_ENABLE_CUDASIM": "0"}, timeout=600)


@pytest.fixture(scope="module")
def results() -> dict:
    """Every simulator case and every PTX variant, in three processes at once."""
    with ThreadPoolExecutor(3) as pool:
        sims = [pool.submit(_simulate, CASE_NAMES[i::2]) for i in range(2)]
        ptx = pool.submit(_compile, _quant_variant_names())
        rows = [row for job in sims for row in job.result()]
        compiled = ptx.result()
    return {"sim": {row["name"]: row for row in rows}, "ptx": {row.get("name", "skip"): row for row in compiled}}


@pytest.mark.parametrize("name", CASE_NAMES)
def test_quantized_kv_in_simulator(results: dict, name: str) -> None:
    row = results["sim"].get(name)
    assert row is not None, f"case {name} produced no result"
    assert row["ok"], row["detail"]


@pytest.mark.parametrize("name", _quant_variant_names())
def test_quantized_variant_compiles_for_sm90(results: dict, name: str) -> None:
    if "skip" in results["ptx"]:
        pytest.skip(f"no CUDA compiler for PTX: {results['ptx']['skip']['skip']}")
    row = results["ptx"][name]
    assert row["sm90_target"] and row["ptx_chars"] > 1000
    assert not row["fp64"], "fp64 arithmetic in a kernel (a float64 constant or argument leaked in)"
    assert row["global_loads"].get("8", 0) > 0 or name.startswith("store"), row["global_loads"]  # byte codes
    if row["ptxas"] is None:
        pytest.skip("ptxas not installed: no stack/spill numbers")
    assert row["spill_bytes"] == 0, row["ptxas"]
    if not name.startswith("attention"):  # the prefill kernel's accumulators live on the stack, as unquantized
        assert row["stack_bytes"] == 0, row["ptxas"]


def test_fast_decode_refuses_quantized_caches() -> None:
    from kvpage.core.kv_formats import CacheFormat, KVFormat
    from kvpage.cuda.quant_ops import check_decode_mode, quantized

    fmt = CacheFormat(KVFormat("fp8_e5m2"), 16)
    with pytest.raises(ValueError, match="the fast decode kernel reads fp16/bf16 KV only; kv_cache_dtype fp8_e5m2"):
        check_decode_mode("fast", fmt)
    with pytest.raises(ValueError, match="decode_kernel must be one of"):
        check_decode_mode("quick", fmt)
    check_decode_mode("auto", fmt)
    check_decode_mode("reference", fmt)
    assert quantized(fmt) is fmt
    assert quantized(CacheFormat(KVFormat("float16"), 16)) is None and quantized(None) is None
    with pytest.raises(ValueError, match="CacheFormat"):
        quantized("int8")


# --- Real GPU: CuPy arrays at real shapes (same checks as the simulator cases) ---

_GPU_REASON = gpu_unavailable_reason()
#: As ``test_cuda_gpu``: fp32 accumulation in another order; fp16 output rounding.
GPU_TOL = {np.float16: dict(rtol=3e-3, atol=2e-3), np.float32: dict(rtol=1e-4, atol=1e-4)}


def _cupy_array(x):
    import cupy

    return cupy.asarray(x)


@pytest.mark.gpu
@pytest.mark.skipif(_GPU_REASON is not None, reason=_GPU_REASON or "")
@pytest.mark.parametrize("name", CASES.FORMATS)
def test_quantized_store_on_gpu(name: str) -> None:
    for dtype in (np.float16, np.float32):
        CASES.check_store(name, 128, dtype, block_size=16, heads=8, to_device=_cupy_array, extra_rows=300)


@pytest.mark.gpu
@pytest.mark.skipif(_GPU_REASON is not None, reason=_GPU_REASON or "")
@pytest.mark.parametrize("name", CASES.FORMATS)
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_quantized_attention_on_gpu(name: str, dtype) -> None:
    shapes = [(1, 1), (1, 17), (1, 700), (1, 2049), (7, 300), (64, 64)]
    for splits in (None, 1):
        CASES.check_attention(name, shapes, 32, 8, 128, dtype, block_size=16, to_device=_cupy_array,
                              tol=GPU_TOL[dtype], num_splits=splits)
    CASES.check_attention(name, [(1, 900), (9, 40)], 32, 8, 128, dtype, block_size=16, seed=1, sliding_window=256,
                          softcap=30.0, with_sinks=True, to_device=_cupy_array, tol=GPU_TOL[dtype])
