"""The numpy-only core of kvpage: what to run each step, and which KV blocks it uses.

Owns: the block pool (``block_pool``), the radix prefix cache (``radix_cache``), per-request
block tables (``kv_cache_manager``) and their KV groups for hybrid models (``kv_groups``),
the iteration-level scheduler (``scheduler``, ``waiting_queue``), request state
(``request``), the per-step metadata handed to a model runner (``metadata``), and
validated configuration (``config``, ``sampling_params``).
Under the prefix cache: stable block hashes (``block_hash``), the lower tiers' indexes and
what moves between them (``tier_pool``, ``kv_offload``, ``kv_transfers``), the scheduler's
side of them (``tier_scheduling``, ``fetch_waits``), and KV events (``kv_events``).

May import: numpy and the standard library only. Never torch, and nothing from
``kvpage.adapters``, ``kvpage.server`` or ``kvpage.bench``: other servers embed this
package as a library (``tests/test_packaging.py`` enforces it).
"""
from __future__ import annotations

from .block_pool import BlockPool, NoFreeBlocksError
from .config import CacheConfig, EngineConfig, SchedulerConfig
from .kv_cache_manager import KVCacheManager
from .kv_groups import KVCacheGroups, KVGroup, plan_kv_groups
from .metadata import StepMetadata, build_step_metadata
from .radix_cache import PrefixMatch, RadixCache
from .request import FinishReason, Request, RequestStatus
from .sampling_params import SamplingParams
from .scheduler import QueueFullError, Scheduler, SchedulerOutput

__all__ = [
    "BlockPool", "NoFreeBlocksError", "CacheConfig", "EngineConfig", "SchedulerConfig", "KVCacheManager",
    "KVCacheGroups", "KVGroup", "plan_kv_groups", "StepMetadata", "build_step_metadata", "PrefixMatch",
    "RadixCache", "FinishReason", "Request", "RequestStatus", "SamplingParams", "QueueFullError", "Scheduler",
    "SchedulerOutput",
]
