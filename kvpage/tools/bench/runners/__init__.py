"""One runner per configuration; ``CONFIGS`` maps a letter to (label, run(ctx) -> RunResult)."""
from __future__ import annotations

from functools import partial

from kvpage.tools.bench.runners import hf_continuous, paged, static_hf
from kvpage.tools.bench.runners.common import Clock, RunContext

CONFIGS = {
    "A": (static_hf.LABEL, static_hf.run),
    "B": (hf_continuous.LABEL, hf_continuous.run),
    "C": (paged.LABELS["C"], partial(paged.run, config="C")),
    "D": (paged.LABELS["D"], partial(paged.run, config="D")),
    "E": (paged.LABELS["E"], partial(paged.run, config="E")),
    "F": (paged.LABELS["F"], partial(paged.run, config="F")),
    "G": (paged.LABELS["G"], partial(paged.run, config="G")),
}

__all__ = ["CONFIGS", "Clock", "RunContext"]
