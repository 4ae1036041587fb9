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
``kvpage.adapters``, ``kvpage.entrypoints.openai`` or ``kvpage.tools.bench``: other servers embed this
package as a library (``tests/test_packaging.py`` enforces it).
"""
from __future__ import annotations

from kvpage.core.kv.block_pool import BlockPool, NoFreeBlocksError
from kvpage.core.config import CacheConfig, EngineConfig, SchedulerConfig
from kvpage.core.kv.kv_cache_manager import KVCacheManager
from kvpage.core.kv.kv_groups import KVCacheGroups, KVGroup, plan_kv_groups
from kvpage.core.sched.metadata import StepMetadata, build_step_metadata
from kvpage.core.kv.radix_cache import PrefixMatch, RadixCache
from kvpage.core.request import FinishReason, Request, RequestStatus
from kvpage.core.sampling_params import SamplingParams
from kvpage.core.sched.output import QueueFullError, SchedulerOutput
from kvpage.core.sched.scheduler import Scheduler

__all__ = [
    "BlockPool", "NoFreeBlocksError", "CacheConfig", "EngineConfig", "SchedulerConfig", "KVCacheManager",
    "KVCacheGroups", "KVGroup", "plan_kv_groups", "StepMetadata", "build_step_metadata", "PrefixMatch",
    "RadixCache", "FinishReason", "Request", "RequestStatus", "SamplingParams", "QueueFullError", "Scheduler",
    "SchedulerOutput",
]
