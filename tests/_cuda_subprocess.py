"""Run a helper in a fresh interpreter and parse its JSON-lines output (for the CUDA tests):
:func:`run_json_lines` is the parent's side, :func:`serve_cases` the helper's.

``python -P`` keeps the repository root off ``sys.path``: there, the top-level ``cuda/``
directory would shadow NVIDIA's ``cuda`` namespace package that numba-cuda imports.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

TESTS_DIR = Path(__file__).resolve().parent


def run_json_lines(args: list[str], env_updates: dict[str, str], timeout: float) -> list[dict]:
    """Run ``python -P *args`` from the tests directory; return its JSON lines, raise on failure."""
    env = dict(os.environ, **env_updates)
    proc = subprocess.run([sys.executable, "-P", *args], cwd=TESTS_DIR, env=env, capture_output=True,
                          text=True, timeout=timeout)
    rows = []
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            rows.append(json.loads(line))
    if proc.returncode != 0 or not rows:
        raise RuntimeError(f"helper {args} exited {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\n"
                           f"stderr:\n{proc.stderr[-3000:]}")
    return rows


def serve_cases(cases: dict[str, Callable[[], object]], names: list[str]) -> int:
    """The helper's side under the simulator: run ``names`` (default: every case), printing one
    JSON line each (``name``, ``ok``, ``detail``: the case's result or its traceback, ``seconds``)."""
    from numba import config

    if not config.ENABLE_CUDASIM:
        sys.exit("set NUMBA_ENABLE_CUDASIM=1 before running this script")
    for name in names or list(cases):
        start = time.perf_counter()
        try:
            detail, ok = cases[name](), True
        except Exception:
            detail, ok = traceback.format_exc(limit=6), False
        print(json.dumps({"name": name, "ok": ok, "detail": detail, "seconds": time.perf_counter() - start}),
              flush=True)
    return 0
