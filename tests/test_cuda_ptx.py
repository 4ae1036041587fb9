"""Compile the kernels to PTX for sm_90 (and assemble with ptxas when present).

The simulator runs kernels as Python, so typing and lowering errors only show up here.
Runs ``python -m kvpage.cuda.ptx_check --json`` in two subprocesses (one per core,
``NUMBA_FORCE_CUDA_CC=9.0``, no simulator); skips with the helper's reason when
libNVVM/libdevice are not installed. ``pytest -s`` prints the report as a table.

Every reference variant is compiled. Of the fast decode variants (``ptx_check.fast_variant_names``,
all compiled by ``benchmarks/gpu_check.sh``), ``FAST`` holds the ones that decide a rule: each
KV dtype, each group size, both head sizes, and each variant whose registers sit closest to
its budget. Their rules:

* 16-bit KV: q, K and V are read with 16-byte loads and nothing narrower than 32 bits.
* 8-bit KV (int8, fp8): q with 16-byte loads, each K and V row slice with one 8-byte load
  (8 one-byte codes), and per key row at most two narrow loads, the K and the V row scale, of
  the scale's width (fp8: 1 byte, int8: 2 bytes) and of no other: no code is loaded alone.
* All: within the register budget of the group's resident blocks (``fast_launch.register_budget``,
  the same for 16- and 8-bit KV), no stack frame, no spills.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from _cuda_subprocess import run_json_lines
from kvpage.cuda.fast_launch import FAST_BLOCKS_PER_SM, FAST_QUANT_DTYPES, register_budget

pytest.importorskip("numba")

REFERENCE = {f"{kind}_{dt}" for dt in ("fp16", "fp32") for kind in (
    "attention_rows8_g8_d128", "attention_prefill_g4_d128", "decode_g4_d128", "decode_g8_d128", "decode_g1_d64",
    "decode_g16_d256", "merge_d128", "store_kv")}
#: (head_dim, group, kv_dtype): ``ptx_check --fast`` shows the rest, within a few registers of these.
FAST_SHAPES = [(64, 1, "fp16"), (128, 4, "fp16"), (128, 8, "bf16"), (128, 1, "int8"), (128, 8, "int8"),
               (64, 1, "fp8_e4m3"), (128, 8, "fp8_e4m3"), (64, 4, "fp8_e5m2"), (64, 1, "int4"), (128, 8, "int4")]
FAST = {f"fast_decode_d{d}_g{g}_{dt}" for d, g, dt in FAST_SHAPES}
#: The width in bits of each 8-bit format's row scale (int4's group scales come in 8-byte loads).
SCALE_BITS = {"int8": "16", "fp8_e4m3": "8", "fp8_e5m2": "8"}


def _compile(names: set[str]) -> list[dict]:
    return run_json_lines(["-m", "kvpage.cuda.ptx_check", "--json", "--only", ",".join(sorted(names))],
                          {"NUMBA_FORCE_CUDA_CC": "9.0", "NUMBA_ENABLE_CUDASIM": "0"}, timeout=600)


@pytest.fixture(scope="module")
def ptx_results() -> dict:
    # Two compiler processes, one per core, about as long each: a fast variant takes about
    # twice a reference one.
    fast = sorted(FAST)
    with ThreadPoolExecutor(2) as pool:
        parts = list(pool.map(_compile, (REFERENCE | set(fast[:1]), set(fast[1:]))))
    for rows in parts:
        if "skip" in rows[0]:
            pytest.skip(f"no CUDA compiler for PTX: {rows[0]['skip']}")
    return {row["name"]: row for rows in parts for row in rows}


@pytest.mark.parametrize("name", sorted(REFERENCE | FAST))
def test_kernel_compiles_for_sm90(ptx_results: dict, name: str) -> None:
    row = ptx_results[name]
    assert row["sm90_target"], "PTX does not target sm_90"
    assert row["ptx_chars"] > 1000
    assert not row["fp64"], "fp64 arithmetic in a kernel (a float64 literal or argument leaked in)"
    if row["ptxas"] is not None:
        assert "0 bytes spill stores" in row["ptxas"], row["ptxas"]


@pytest.mark.parametrize("name", sorted(FAST))
def test_fast_variant_loads_and_resources(ptx_results: dict, name: str) -> None:
    row = ptx_results[name]
    assert row["fast"]
    loads, steps = row["global_loads"], row["unroll"]  # steps: key rows a lane loads per iteration
    if row["kv_dtype"] == "int4":
        assert loads.get("128", 0) >= row["group"], loads  # q
        assert loads.get("64", 0) >= 4 * steps, loads  # 8-byte K and V code and scale loads per key row
        assert not {"8", "16"} & set(loads), f"narrow loads besides metadata: {loads}"
    elif row["kv_dtype"] in FAST_QUANT_DTYPES:
        scale = SCALE_BITS[row["kv_dtype"]]
        assert loads.get("128", 0) >= row["group"], loads  # q
        assert loads.get("64", 0) >= 2 * steps, loads  # one 8-byte K and V code load per key row
        assert 0 < loads.get(scale, 0) <= 2 * steps, f"more than 2 narrow loads per key row: {loads}"
        assert ("8" if scale == "16" else "16") not in loads, f"narrow loads besides the scales: {loads}"
    else:
        # q (one per head) and, per unrolled step, one K and one V row slice: all 16-byte loads.
        assert loads.get("128", 0) >= row["group"] + 2 * steps, loads
        assert "16" not in loads and "8" not in loads, f"narrow global loads: {loads}"
    if row["ptxas"] is None:
        pytest.skip("ptxas not installed: no register/stack/spill numbers")
    assert row["stack_bytes"] == 0 and row["spill_bytes"] == 0, row["ptxas"]
    assert row["registers"] <= register_budget(row["group"]), row["ptxas"]
    assert row["smem_bytes"] * FAST_BLOCKS_PER_SM[row["group"]] <= 200 * 1024


def test_every_kernel_variant_is_checked(ptx_results: dict) -> None:
    from kvpage.cuda.fast_launch import FAST_GROUPS, FAST_HEAD_DIMS, FAST_KV_DTYPES
    from kvpage.cuda.ptx_check import fast_variant_names

    assert set(ptx_results) == REFERENCE | FAST
    assert {name for name, row in ptx_results.items() if row["fast"]} == FAST
    assert FAST <= set(fast_variant_names())
    for axis, values in ((0, FAST_HEAD_DIMS), (1, FAST_GROUPS), (2, FAST_KV_DTYPES + FAST_QUANT_DTYPES)):
        assert {shape[axis] for shape in FAST_SHAPES} == set(values)


def test_report_table(ptx_results: dict) -> None:
    """The table ``python -m kvpage.cuda.ptx_check`` prints (shown with ``pytest -s``)."""
    from kvpage.cuda.ptx_check import format_table

    table = format_table(sorted(ptx_results.values(), key=lambda r: (r["fast"], r["name"])))
    print("\n" + table)
    assert len(table.splitlines()) == len(ptx_results) + 1
