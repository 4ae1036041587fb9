"""A description of the machine a benchmark ran on (for the JSON report)."""
from __future__ import annotations

import os
import platform
from typing import Any


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe() -> dict[str, Any]:
    """CPU model, logical CPUs usable, torch threads, library versions and the GPU if any."""
    import torch
    import transformers

    gpu = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        gpu = {"name": props.name, "memory_bytes": int(props.total_memory), "count": torch.cuda.device_count()}
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cpu_model": _cpu_model(), "logical_cpus": os.cpu_count(), "usable_cpus": usable,
        "torch_threads": torch.get_num_threads(), "platform": platform.platform(),
        "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
        "gpu": gpu,
    }
