"""kvpage: a paged KV-cache manager for LLM serving.

The core (block pool, radix prefix cache, scheduler, per-step metadata) needs numpy
only. The HF integration (``LLM``) is imported lazily, so ``import kvpage`` never
pulls in torch, transformers, cupy or numba-cuda.
"""
from __future__ import annotations

from .block_pool import BlockPool, NoFreeBlocksError
from .config import CacheConfig, SchedulerConfig
from .kv_cache_manager import KVCacheManager
from .metadata import StepMetadata, build_step_metadata
from .radix_cache import PrefixMatch, RadixCache
from .request import FinishReason, Request, RequestStatus
from .sampling_params import SamplingParams
from .scheduler import QueueFullError, Scheduler, SchedulerOutput

__version__ = "0.1.0"

__all__ = [
    "BlockPool", "NoFreeBlocksError", "CacheConfig", "SchedulerConfig", "KVCacheManager",
    "StepMetadata", "build_step_metadata", "PrefixMatch", "RadixCache", "FinishReason",
    "Request", "RequestStatus", "SamplingParams", "QueueFullError", "Scheduler", "SchedulerOutput",
]
# ``LLM``, ``AsyncLLM`` and ``LLMEngine`` are reachable as attributes (imported on first use)
# but kept out of ``__all__``, so that a star import stays light.

_LAZY = {"LLM": ("kvpage.llm", "LLM"), "AsyncLLM": ("kvpage.async_engine", "AsyncLLM"),
         "LLMEngine": ("kvpage.engine", "LLMEngine")}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module_name, attr = _LAZY[name]
        return getattr(importlib.import_module(module_name), attr)
    raise AttributeError(f"module 'kvpage' has no attribute {name!r}")
