"""Quantized KV caches in the Numba CUDA kernels (``kvpage.cuda`` with ``cache_format``).

* Simulator (``cuda_quant_cases.py``, two subprocesses with ``NUMBA_ENABLE_CUDASIM=1``): per
  quantized format, ``store_kv`` writes exactly ``kv_quant.quantize_rows``' bytes, and decode,
  prefill and a mixed step match the numpy oracle on the dequantized cache (the tolerances
  are argued in that module's docstring).
* PTX (one subprocess, no simulator): the quantized store, decode and prefill variants compile
  for sm_90 (typing and lowering errors the simulator hides), with no fp64 arithmetic, no
  spills, and the store and decode kernels without a stack frame.
* Here: the launch-side checks that need no kernel, and which decode kernel a call gets
  (int8/fp8 with float16 q: the fast kernel under ``"auto"`` outside the simulator; int4,
  float32 q, other head sizes and unaligned blocks: the reference kernel).
* Real GPU (``gpu`` marker, skipped without CuPy and a device): the same checks with CuPy
  arrays at a real model's shapes (head_dim 128, block_size 16, GQA 4, contexts up to ~2k),
  and the fast kernel on int8/fp8 caches against the oracle and the reference kernel.
The fast kernel's PTX (8-byte code loads, registers) is checked in ``test_cuda_ptx.py``.
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


def _decode_choice(name: str, mode: str, q_dtype=np.float16, head_dim: int = 128, block_size: int = 16,
                   kv_heads: int = 2, group: int = 4) -> bool:
    """``fast_dispatch.use_fast_decode`` for host arrays of a quantized cache (nothing launches)."""
    from kvpage.core.kv_formats import CacheFormat, KVFormat
    from kvpage.cuda.fast_dispatch import use_fast_decode

    fmt = CacheFormat(KVFormat(name), block_size)
    buf = np.zeros(fmt.kv_format.buffer_shape(3, block_size, kv_heads, head_dim), np.uint8)
    q = np.zeros((2, kv_heads * group, head_dim), q_dtype)
    return use_fast_decode(mode, q, buf, buf, head_dim, group, False, fmt)


@pytest.mark.parametrize("name", CASES.FAST_FORMATS)
def test_auto_picks_the_fast_kernel_for_quantized_caches(name: str) -> None:
    from kvpage.cuda.interop import simulator_enabled

    if simulator_enabled():
        pytest.skip("under the simulator 'auto' takes the reference kernel")
    for group, head_dim in ((1, 64), (4, 128), (8, 128)):
        assert _decode_choice(name, "auto", group=group, head_dim=head_dim)
        assert _decode_choice(name, "fast", group=group, head_dim=head_dim)
    assert not _decode_choice(name, "reference")
    assert not _decode_choice(name, "auto", q_dtype=np.float32)  # float32 q: the reference kernel
    assert not _decode_choice(name, "auto", head_dim=96)


@pytest.mark.parametrize("name,over,match", [
    ("int4", dict(q_dtype=np.float32), "q must be float16 for the fast kernel over int4 caches"),
    ("int8", dict(q_dtype=np.float32), "q must be float16 for the fast kernel over int8 caches"),
    ("fp8_e4m3", dict(head_dim=96), "no fast variant for head_dim 96"),
    ("fp8_e5m2", dict(group=2), "group 2"),
    ("fp8_e4m3", dict(block_size=3, kv_heads=1), "block of 387 bytes is not a multiple of 8"),
])
def test_fast_mode_says_why_not_for_quantized_caches(name: str, over: dict, match: str) -> None:
    assert not _decode_choice(name, "auto", **over)
    with pytest.raises(ValueError, match=match):
        _decode_choice(name, "fast", **over)


def test_decode_kernel_mode_and_format_checks() -> None:
    from kvpage.core.kv_formats import CacheFormat, KVFormat
    from kvpage.cuda.quant_ops import quantized

    with pytest.raises(ValueError, match="decode_kernel must be one of"):
        _decode_choice("int8", "quick")
    fmt = CacheFormat(KVFormat("fp8_e5m2"), 16)
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


@pytest.mark.gpu
@pytest.mark.skipif(_GPU_REASON is not None, reason=_GPU_REASON or "")
@pytest.mark.parametrize("name,group,head_dim", [("int8", 4, 128), ("fp8_e4m3", 8, 128), ("fp8_e5m2", 1, 64),
                                                 ("fp8_e4m3", 4, 128), ("int8", 8, 64)])
def test_fast_quantized_decode_on_gpu(name: str, group: int, head_dim: int) -> None:
    """The fast kernel (``decode_kernel="fast"``) on real 8-bit caches against the oracle, with
    split-K sized from the SM count and with one split (``benchmarks/gpu_check_report.py``
    compares it with the reference kernel at batch 32)."""
    decodes = [(1, n) for n in (1, 15, 16, 17, 700, 2049, 4100, 129)]
    common = dict(block_size=16, to_device=_cupy_array, tol=GPU_TOL[np.float16])
    for splits in (None, 1):
        CASES.check_attention(name, decodes, 4 * group, 4, head_dim, np.float16, seed=group, decode_kernel="fast",
                              num_splits=splits, **common)
    CASES.check_attention(name, decodes, 4 * group, 4, head_dim, np.float16, seed=3, sliding_window=512,
                          softcap=30.0, with_sinks=True, spread=2.0, decode_kernel="fast", **common)
