"""The documentation holds: README.md stays a short front page whose architecture section
names code that exists, and the MkDocs site under docs/ builds with every internal link and
anchor resolving (``mkdocs build --strict``; mkdocs.yml turns anchor checks into warnings).
"""
from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MAX_README_LINES = 250
# A backticked dotted name in the kvpage package: `kvpage.core.sched.scheduler.Scheduler.schedule`.
DOTTED_NAME = re.compile(r"`(kvpage(?:\.[A-Za-z_][A-Za-z0-9_]*)+)`")


def architecture_section(text: str) -> str:
    """The README's ``## Architecture`` section, up to the next second-level heading."""
    match = re.search(r"^## Architecture\s*$(.*?)(?=^## |\Z)", text, re.MULTILINE | re.DOTALL)
    assert match, "README.md has no '## Architecture' section"
    return match.group(1)


def resolve(dotted: str) -> object:
    """Import the longest importable module prefix of ``dotted``, then getattr the rest.

    Raises ``ImportError`` or ``AttributeError`` naming the part that does not exist."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            obj = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name is not None and not module_name.startswith(exc.name):
                raise  # the module exists but one of its own imports is missing
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(f"no module of {dotted!r} imports")


def test_readme_is_a_short_front_page():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines (at most {MAX_README_LINES})"


def test_readme_architecture_names_resolve():
    names = sorted(set(DOTTED_NAME.findall(architecture_section(README.read_text(encoding="utf-8")))))
    assert names, "the architecture section names no kvpage.* code"
    missing = []
    for name in names:
        try:
            resolve(name)
        except (ImportError, AttributeError) as exc:
            missing.append(f"{name}: {type(exc).__name__}: {exc}")
    assert not missing, "README.md's architecture section names code that does not exist:\n" + "\n".join(missing)


def test_mkdocs_site_builds_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is not installed (the dev extra)")
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
