"""Every Numba CUDA kernel under the simulator, against the numpy reference.

The cases live in ``cuda_sim_cases.py`` and run in one subprocess with
``NUMBA_ENABLE_CUDASIM=1`` (it must be set before ``numba.cuda`` is imported, which this
process may already have done). Each case is reported as its own test.
"""
from __future__ import annotations

import importlib.util
import sys

import pytest

from _cuda_subprocess import TESTS_DIR, run_json_lines

pytest.importorskip("numba")


def _case_names() -> list[str]:
    spec = importlib.util.spec_from_file_location("cuda_sim_cases", TESTS_DIR / "cuda_sim_cases.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)  # imports numpy only: kernels load inside the cases
    return list(module.CASES)


CASE_NAMES = _case_names()


@pytest.fixture(scope="module")
def sim_results() -> dict:
    rows = run_json_lines(["cuda_sim_cases.py"], {"NUMBA_ENABLE_CUDASIM": "1"}, timeout=300)
    return {row["name"]: row for row in rows}


@pytest.mark.parametrize("name", CASE_NAMES)
def test_kernel_in_simulator(sim_results: dict, name: str) -> None:
    row = sim_results.get(name)
    assert row is not None, f"case {name} produced no result"
    assert row["ok"], row["detail"]
