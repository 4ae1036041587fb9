"""kvpage: a paged KV-cache manager for LLM serving.

Layers, each importing only those below it (``tests/test_layers.py`` holds the contracts)::

    kvpage.entrypoints.cli                       the ``kvpage`` command line
    kvpage.tools                                 ``kvpage bench`` and ``kvpage census``
    kvpage.entrypoints.{ray_serve,openai,llm}    Ray Serve, the OpenAI server, the ``LLM`` API
    kvpage.engine                                the step loop, AsyncLLM, outputs, sampler, builder
    kvpage.adapters                              the model runner (Hugging Face models)
    kvpage.attention, kvpage.cuda                paged attention backends and CUDA kernels
    kvpage.storage                               paged K/V buffers, sizing, the tiers' bytes
    kvpage.kernels                               native and Numba CPU kernels
    kvpage.platform                              threads, malloc tuning, model and cache paths
    kvpage.core                                  scheduler, KV blocks, metadata (numpy only)

``import kvpage`` loads the core only; ``LLM``, ``AsyncLLM`` and ``LLMEngine`` load on
first use, so it never pulls in torch, transformers, cupy or numba-cuda.
"""
from __future__ import annotations

import importlib

from kvpage.core import (BlockPool, CacheConfig, EngineConfig, FinishReason, KVCacheManager, NoFreeBlocksError,
                         PrefixMatch, QueueFullError, RadixCache, Request, RequestStatus, SamplingParams, Scheduler,
                         SchedulerConfig, SchedulerOutput, StepMetadata, build_step_metadata)

__version__ = "0.2.0"

__all__ = [
    "BlockPool", "NoFreeBlocksError", "CacheConfig", "EngineConfig", "SchedulerConfig", "KVCacheManager",
    "StepMetadata", "build_step_metadata", "PrefixMatch", "RadixCache", "FinishReason",
    "Request", "RequestStatus", "SamplingParams", "QueueFullError", "Scheduler", "SchedulerOutput",
]

# ``LLM``, ``patch``, ``AsyncLLM`` and ``LLMEngine`` are reachable as attributes (imported on first use)
# but kept out of ``__all__``, so that a star import stays light.
_LAZY = {"LLM": ("kvpage.entrypoints.llm", "LLM"), "patch": ("kvpage.entrypoints.llm", "patch"),
         "AsyncLLM": ("kvpage.engine.async_llm", "AsyncLLM"), "LLMEngine": ("kvpage.engine.llm_engine", "LLMEngine")}


def __getattr__(name: str):
    if name in _LAZY:
        module_name, attr = _LAZY[name]
        return getattr(importlib.import_module(module_name), attr)
    raise AttributeError(f"module 'kvpage' has no attribute {name!r}")
