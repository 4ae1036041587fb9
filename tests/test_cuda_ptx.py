"""Compile every kernel to PTX for sm_90 (and assemble with ptxas when present).

The simulator runs kernels as Python, so typing and lowering errors only show up here.
Runs in a subprocess (``NUMBA_FORCE_CUDA_CC=9.0``, no simulator). Skips with the
helper's reason when libNVVM/libdevice are not installed.
"""
from __future__ import annotations

import pytest

from _cuda_subprocess import run_json_lines

pytest.importorskip("numba")

EXPECTED = {f"{kind}_{dt}" for dt in ("fp16", "fp32") for kind in (
    "attention_rows8_g8_d128", "attention_prefill_g4_d128", "decode_g4_d128", "decode_g8_d128", "decode_g1_d64",
    "decode_g16_d256", "merge_d128", "store_kv")}


@pytest.fixture(scope="module")
def ptx_results() -> dict:
    rows = run_json_lines(["-m", "kvpage.cuda.ptx_check", "--json"],
                          {"NUMBA_FORCE_CUDA_CC": "9.0", "NUMBA_ENABLE_CUDASIM": "0"}, timeout=300)
    if "skip" in rows[0]:
        pytest.skip(f"no CUDA compiler for PTX: {rows[0]['skip']}")
    return {row["name"]: row for row in rows}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_kernel_compiles_for_sm90(ptx_results: dict, name: str) -> None:
    row = ptx_results[name]
    assert row["sm90_target"], "PTX does not target sm_90"
    assert row["ptx_chars"] > 1000
    assert not row["fp64"], "fp64 arithmetic in a kernel (a float64 literal or argument leaked in)"
    if row["ptxas"] is not None:
        assert "0 bytes spill stores" in row["ptxas"], row["ptxas"]


def test_every_kernel_variant_is_checked(ptx_results: dict) -> None:
    assert set(ptx_results) == EXPECTED
