"""Compile every kernel to PTX for sm_90 (and assemble with ptxas when present).

The simulator runs kernels as Python, so typing and lowering errors only show up here.
Runs ``python -m kvpage.cuda.ptx_check --json`` once per session in a subprocess
(``NUMBA_FORCE_CUDA_CC=9.0``, no simulator); skips with the helper's reason when
libNVVM/libdevice are not installed. ``pytest -s`` prints the report as a table.

Every fast decode variant must read K/V (and q) with 16-byte loads and nothing narrower than
32 bits, and keep to its register budget (``fast_launch.register_budget``: the resident
blocks per SM it is sized for) without a stack frame or spills.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from _cuda_subprocess import run_json_lines
from kvpage.cuda.fast_launch import (FAST_BLOCKS_PER_SM, FAST_GROUPS, FAST_HEAD_DIMS, FAST_KV_DTYPES,
                                     register_budget)

pytest.importorskip("numba")

REFERENCE = {f"{kind}_{dt}" for dt in ("fp16", "fp32") for kind in (
    "attention_rows8_g8_d128", "attention_prefill_g4_d128", "decode_g4_d128", "decode_g8_d128", "decode_g1_d64",
    "decode_g16_d256", "merge_d128", "store_kv")}
FAST = {f"fast_decode_d{d}_g{g}_{dt}" for d in FAST_HEAD_DIMS for g in FAST_GROUPS for dt in FAST_KV_DTYPES}


def _compile(names: set[str]) -> list[dict]:
    return run_json_lines(["-m", "kvpage.cuda.ptx_check", "--json", "--only", ",".join(sorted(names))],
                          {"NUMBA_FORCE_CUDA_CC": "9.0", "NUMBA_ENABLE_CUDASIM": "0"}, timeout=600)


@pytest.fixture(scope="module")
def ptx_results() -> dict:
    # Two compiler processes, one per core: the reference and the fast variants take about as long.
    with ThreadPoolExecutor(2) as pool:
        parts = list(pool.map(_compile, (REFERENCE, FAST)))
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
    loads = row["global_loads"]
    # q (one per head) and, per unrolled step (``decode_fast.UNROLL`` = 4), one K and one V row
    # slice: all 16-byte loads.
    assert loads.get("128", 0) >= row["group"] + 2 * 4, loads
    assert "16" not in loads and "8" not in loads, f"narrow global loads: {loads}"
    if row["ptxas"] is None:
        pytest.skip("ptxas not installed: no register/stack/spill numbers")
    assert row["stack_bytes"] == 0 and row["spill_bytes"] == 0, row["ptxas"]
    assert row["registers"] <= register_budget(row["group"]), row["ptxas"]
    assert row["smem_bytes"] * FAST_BLOCKS_PER_SM[row["group"]] <= 200 * 1024


def test_every_kernel_variant_is_checked(ptx_results: dict) -> None:
    assert set(ptx_results) == REFERENCE | FAST
    assert {name for name, row in ptx_results.items() if row["fast"]} == FAST


def test_report_table(ptx_results: dict) -> None:
    """The table ``python -m kvpage.cuda.ptx_check`` prints (shown with ``pytest -s``)."""
    from kvpage.cuda.ptx_check import format_table

    table = format_table(sorted(ptx_results.values(), key=lambda r: (r["fast"], r["name"])))
    print("\n" + table)
    assert len(table.splitlines()) == len(ptx_results) + 1
