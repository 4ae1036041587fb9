"""Run a helper in a fresh interpreter and parse its JSON-lines output (for the CUDA tests).

``python -P`` keeps the repository root off ``sys.path``: there, the top-level ``cuda/``
directory would shadow NVIDIA's ``cuda`` namespace package that numba-cuda imports.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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
