"""kvpage: a paged KV-cache manager for LLM serving.

Layers, each importing only those below it::

    kvpage.server, kvpage.bench, kvpage.cli       HTTP API, benchmarks, command line
    kvpage.llm, kvpage.async_engine               LLM / AsyncLLM front ends
    kvpage.engine, kvpage.output_processor        the step loop; what the user sees
    kvpage.adapters (HF runner), kvpage.sampler   model forward, sampling (torch)
    kvpage.attention, kvpage.cuda                 paged attention kernels
    kvpage.core                                   scheduler, KV blocks, metadata (numpy only)

``import kvpage`` loads the core only; ``LLM``, ``AsyncLLM`` and ``LLMEngine`` load on
first use, so it never pulls in torch, transformers, cupy or numba-cuda.
"""
from __future__ import annotations

import importlib
import sys

from .core import (BlockPool, CacheConfig, EngineConfig, FinishReason, KVCacheManager, NoFreeBlocksError,
                   PrefixMatch, QueueFullError, RadixCache, Request, RequestStatus, SamplingParams, Scheduler,
                   SchedulerConfig, SchedulerOutput, StepMetadata, build_step_metadata)

__version__ = "0.2.0"

__all__ = [
    "BlockPool", "NoFreeBlocksError", "CacheConfig", "EngineConfig", "SchedulerConfig", "KVCacheManager",
    "StepMetadata", "build_step_metadata", "PrefixMatch", "RadixCache", "FinishReason",
    "Request", "RequestStatus", "SamplingParams", "QueueFullError", "Scheduler", "SchedulerOutput",
]

# The core modules lived at the top of the package before ``kvpage.core`` existed; their
# old import paths (``kvpage.scheduler``, ...) name the same module objects.
for _name in ("block_pool", "config", "kv_cache_manager", "metadata", "radix_cache", "request",
              "sampling_params", "scheduler", "waiting_queue"):
    sys.modules[f"{__name__}.{_name}"] = globals()[_name] = importlib.import_module(f".core.{_name}", __name__)
del _name

# ``LLM``, ``AsyncLLM`` and ``LLMEngine`` are reachable as attributes (imported on first use)
# but kept out of ``__all__``, so that a star import stays light.
_LAZY = {"LLM": ("kvpage.llm", "LLM"), "AsyncLLM": ("kvpage.async_engine", "AsyncLLM"),
         "LLMEngine": ("kvpage.engine", "LLMEngine")}


def __getattr__(name: str):
    if name in _LAZY:
        module_name, attr = _LAZY[name]
        return getattr(importlib.import_module(module_name), attr)
    raise AttributeError(f"module 'kvpage' has no attribute {name!r}")
