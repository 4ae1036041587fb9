"""Where kvpage keeps what it builds once per machine: converted models, native kernels, compile caches."""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$KVPAGE_CACHE`` or ``$XDG_CACHE_HOME/kvpage`` (default ``~/.cache/kvpage``)."""
    explicit = os.environ.get("KVPAGE_CACHE")
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvpage"
