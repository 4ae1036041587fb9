"""Import hygiene: the core is torch-free, and the repo's cuda/ never shadows NVIDIA's ``cuda``."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "cupy", "numba.cuda", "numba")


def run_python(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().splitlines()[-1]


def test_import_kvpage_pulls_in_no_heavy_framework():
    code = (
        "import sys, json, kvpage\n"
        "from kvpage import *\n"
        f"print(json.dumps(sorted(m for m in {list(HEAVY)!r} if m in sys.modules)))\n"
    )
    assert json.loads(run_python(code)) == []


def test_core_modules_import_without_heavy_frameworks():
    code = (
        "import sys, json\n"
        "import kvpage.core.kv.block_pool, kvpage.core.kv.radix_cache, kvpage.core.kv.kv_cache_manager, kvpage.core.sched.scheduler, kvpage.core.sched.metadata\n"
        "import kvpage.cuda, kvpage.adapters\n"
        f"print(json.dumps(sorted(m for m in {list(HEAVY)!r} if m in sys.modules)))\n"
    )
    assert json.loads(run_python(code)) == []


def cuda_namespace_paths(cwd: Path) -> list[str]:
    """The ``cuda`` package's search path as seen by a fresh interpreter started in ``cwd``."""
    code = (
        "import importlib.util, json\n"
        "spec = importlib.util.find_spec('cuda')\n"
        "print(json.dumps([] if spec is None else [str(p) for p in spec.submodule_search_locations or []]))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_no_top_level_cuda_package_shadows_nvidia(tmp_path):
    """From the repo root as cwd (``''`` first on sys.path), NVIDIA's ``cuda`` namespace must
    stay reachable: ``import cuda`` may find the repo's dir only if it joins that namespace."""
    nvidia = cuda_namespace_paths(tmp_path)
    if not nvidia:
        pytest.skip("no NVIDIA cuda namespace installed")
    code = "import json, cuda\nprint(json.dumps([str(p) for p in getattr(cuda, '__path__', [])]))\n"
    seen = {Path(p).resolve() for p in json.loads(run_python(code))}
    missing = [p for p in nvidia if Path(p).resolve() not in seen]
    assert not missing, f"the repo's cuda/ hides NVIDIA's cuda namespace portions {missing}"


def test_from_numba_import_cuda_works_from_the_repo_root(tmp_path):
    code = "from numba import cuda\nprint(cuda.__name__)\n"
    elsewhere = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    if elsewhere.returncode != 0:
        pytest.skip("numba-cuda (with NVIDIA's cuda bindings) is not importable here at all")
    assert run_python(code) == "numba.cuda"


def test_kvpage_cuda_resolves_to_the_repo_cuda_dir():
    code = "import json, kvpage.cuda, kvpage.adapters\nprint(json.dumps([kvpage.cuda.__file__, kvpage.adapters.__file__]))\n"
    cuda_file, adapters_file = (Path(p).resolve() for p in json.loads(run_python(code)))
    assert cuda_file == REPO / "cuda" / "__init__.py"
    assert adapters_file == REPO / "adapters" / "__init__.py"


def test_core_imports_nothing_above_it():
    """``kvpage.core`` is the bottom layer: no torch, no adapters, server, bench or front end."""
    above = ["torch", "transformers", "kvpage.adapters", "kvpage.entrypoints", "kvpage.tools", "kvpage.engine",
             "kvpage.storage", "kvpage.kernels", "kvpage.platform", "kvpage.attention", "kvpage.cuda"]
    code = (
        "import sys, json, importlib, pkgutil, kvpage.core\n"
        "for m in pkgutil.walk_packages(kvpage.core.__path__, 'kvpage.core.'):\n"
        "    importlib.import_module(m.name)\n"
        f"print(json.dumps(sorted(m for m in {above!r} if m in sys.modules)))\n"
    )
    assert json.loads(run_python(code)) == []


def test_core_sources_import_only_numpy_and_the_standard_library():
    import ast

    allowed = set(sys.stdlib_module_names) | {"numpy", "__future__"}
    for path in (REPO / "kvpage" / "core").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                assert name.split(".")[0] in allowed or name.startswith("kvpage.core."), f"{path.name} imports {name}"


def test_lower_layers_never_import_the_front_end():
    """Adapters, engine and kernels import without loading ``kvpage.entrypoints.llm`` or the server."""
    code = (
        "import sys, json\n"
        "import kvpage.engine.llm_engine, kvpage.engine.output_processor, kvpage.engine.interfaces, kvpage.adapters\n"
        "import kvpage.engine.builder, kvpage.adapters.hf_runner, kvpage.attention.cpu\n"
        "print(json.dumps(sorted(m for m in ['kvpage.entrypoints.llm', 'kvpage.entrypoints.openai', 'kvpage.tools.bench', 'kvpage.engine.async_llm']"
        " if m in sys.modules)))\n"
    )
    assert json.loads(run_python(code)) == []


def test_engine_needs_no_tensor_library():
    code = (
        "import sys, json\n"
        "import kvpage.engine.llm_engine, kvpage.engine.output_processor, kvpage.engine.async_llm\n"
        f"print(json.dumps(sorted(m for m in {list(HEAVY)!r} if m in sys.modules)))\n"
    )
    assert json.loads(run_python(code)) == []


def test_ray_is_imported_only_by_the_ray_serve_package():
    code = (
        "import sys, json, kvpage, kvpage.entrypoints.cli.main, kvpage.core.block_hash, kvpage.entrypoints.ray_serve.prefix_policy\n"
        "kvpage.entrypoints.cli.main.build_parser().parse_args(['serve', '--replicas', '2'])\n"
        "print(json.dumps('ray' in sys.modules))\n"
    )
    assert json.loads(run_python(code)) is False
