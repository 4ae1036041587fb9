"""The numpy-only core of kvpage: what to run each step, and which KV blocks it uses.

Three layers over a shared vocabulary (``config``, ``request``, ``sampling_params``,
``block_hash``, ``kv_events``), each importing only those below it:

    sched     who runs: the iteration-level ``scheduler`` and its ``policy``, ``admission``,
              ``waiting_queue``, the per-step ``metadata`` handed to a model runner, and the
              scheduler's side of the lower tiers (``tier_scheduling``, ``fetch_waits``)
    kv        which blocks: the ``block_pool``, the ``radix_cache`` prefix cache, per-request
              block tables (``kv_cache_manager`` over one manager per kind in
              ``kind_managers``, ``prefix_hits``) and KV groups for hybrid models (``kv_groups``)
    offload   the lower tiers' indexes and what moves between them (``tier_pool``,
              ``kv_offload``, ``kv_transfers``)

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
from kvpage.core.kv.radix_cache import RadixCache
from kvpage.core.kv.radix_node import PrefixMatch
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
