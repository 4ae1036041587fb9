"""The package's layers hold: import-linter's contracts (pyproject.toml) and no import cycles.

Both read the *installed* layout, where ``cuda/`` and ``adapters/`` are ``kvpage/cuda`` and
``kvpage/adapters``: the sources are copied into that shape under a temporary folder, since
the static analysers walk folders and never see the repository's package-dir mapping.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytest.importorskip("importlinter")
grimp = pytest.importorskip("grimp")


@pytest.fixture(scope="module")
def installed_layout(tmp_path_factory) -> Path:
    """A folder holding ``kvpage/`` as a wheel installs it (Python sources only)."""
    root = tmp_path_factory.mktemp("layout")
    sources = {"kvpage": REPO / "kvpage", "kvpage/cuda": REPO / "cuda", "kvpage/adapters": REPO / "adapters"}
    for target, source in sources.items():
        for path in source.rglob("*.py"):
            dest = root / target / path.relative_to(source)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, dest)
    shutil.copyfile(REPO / "pyproject.toml", root / "pyproject.toml")
    return root


def test_the_layer_contracts_hold(installed_layout):
    lint_imports = Path(sys.executable).with_name("lint-imports")
    env = dict(os.environ, PYTHONPATH=str(installed_layout))
    proc = subprocess.run([str(lint_imports), "--config", "pyproject.toml", "--no-cache"], cwd=installed_layout,
                          env=env, capture_output=True, text=True, timeout=300)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def import_cycles(graph) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    for start in sorted(graph.modules):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.find_modules_directly_imported_by(start))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    cycles.append(sorted(group))
    return cycles


def test_no_import_cycles_among_product_modules(installed_layout, monkeypatch):
    monkeypatch.syspath_prepend(str(installed_layout))
    for name in [m for m in sys.modules if m == "kvpage" or m.startswith("kvpage.")]:
        monkeypatch.delitem(sys.modules, name)
    graph = grimp.build_graph("kvpage", cache_dir=None)
    assert {"kvpage.cuda.ops", "kvpage.adapters.hf_runner", "kvpage.core.sched.scheduler"} <= graph.modules
    assert import_cycles(graph) == []
