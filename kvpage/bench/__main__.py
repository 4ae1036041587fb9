"""``python -m kvpage.bench [options]``: the same as ``kvpage bench``."""
from __future__ import annotations

import sys

from kvpage.bench_cli import main

if __name__ == "__main__":
    sys.exit(main())
