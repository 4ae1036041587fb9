"""The lower KV tiers' bytes: host memory and the persistent disk cache (runner side).

The core (``kvpage.core.offload.kv_offload``) decides what moves; this package owns the memory and
files and moves the bytes when the engine hands it a step's plan:

    host_buffers.py   the host tier's tensors, and the copies to and from the pool's buffers
    disk_store.py     one safetensors file per block, atomic writes, checksummed reads
    fingerprint.py    the model/dtype/block-size fingerprint that keys the disk folder
    agent.py          ``KVTierAgent``: runs each step's copies; disk I/O on two threads
    histogram.py      transfer latency histograms for ``stats()`` and ``/metrics``

``open_kv_tiers`` makes the agent for a scheduler that has tiers (imports torch).
"""
from __future__ import annotations

import logging
import shutil
from typing import TYPE_CHECKING, Any, Optional

from kvpage.core.config import EngineConfig
from kvpage.core.sched.tier_scheduling import TierScheduling
from kvpage.storage.paged_cache import PagedKVCache
from kvpage.storage.sizing import free_ram_bytes
from kvpage.storage.spec import KVCacheSpec

if TYPE_CHECKING:
    from kvpage.storage.tiers.agent import KVTierAgent

log = logging.getLogger("kvpage")


def open_kv_tiers(tiers: Optional[TierScheduling], config: EngineConfig, spec: KVCacheSpec,
                  kv_cache: PagedKVCache, model: Any) -> Optional["KVTierAgent"]:
    """The ``KVTierAgent`` for a scheduler's ``tiers`` (None without tiers).

    Opens the disk folder (a folder that cannot be written makes a read-only tier, one that
    cannot be read an empty one, each with a warning), indexes the blocks it holds into
    ``tiers`` and deletes those past the size cap. ``model`` keys the disk folder.
    """
    from kvpage.storage.tiers.agent import KVTierAgent

    if tiers is None:
        return None
    offload = tiers.offload
    host_bytes, free_ram = offload.host.num_slots * spec.bytes_per_block, free_ram_bytes()
    if host_bytes > free_ram:
        raise ValueError(f"the host KV tier needs {host_bytes / 2**30:.2f} GiB (kv_offloading_size) but only "
                         f"{free_ram / 2**30:.2f} GiB of RAM is available")
    disk, writable, problem = None, False, None
    if offload.disk is not None and config.kv_disk_cache:
        disk, writable, problem = _open_disk(tiers, config.kv_disk_cache, spec, kv_cache, model)
    agent = KVTierAgent(kv_cache, offload.host.num_slots, disk, writable)
    if problem:
        agent.note_unwritable(problem)
    log.info("KV tiers: host %d blocks (%.1f MiB)%s", offload.host.num_slots,
             offload.host.num_slots * spec.bytes_per_block / 2**20,
             "" if disk is None else f", disk {offload.disk.num_slots} blocks at {disk.dir} "
             f"({len(offload.disk)} restored{'' if writable else ', read-only'})")
    return agent


def _open_disk(tiers: TierScheduling, folder: str, spec: KVCacheSpec, kv_cache: PagedKVCache, model: Any) -> tuple:
    """(the disk store, whether it is writable, why not or None), its blocks indexed in ``tiers``."""
    from kvpage.storage.tiers.disk_store import DiskKVStore
    from kvpage.storage.tiers.fingerprint import model_fingerprint

    disk = DiskKVStore(folder, model_fingerprint(model, spec), disk_block_shape(spec),
                       kv_cache.torch_key_cache(0).dtype)
    writable, problem = disk.open()
    _warn_if_disk_is_small(disk, tiers.offload.disk.num_slots * spec.bytes_per_block)
    found = disk.scan(remove_leftovers=writable)
    for op in tiers.restore_disk(found, writable):
        if writable:
            disk.remove(op.block_hash)
    return disk, writable, problem


def disk_block_shape(spec: Any) -> tuple:
    """``[layers, block_size, heads, head_dim]`` of one block file's K (and V) tensor, or for
    a quantized KV format ``[layers, block_bytes]`` (each layer's block: codes, then scales).

    A file stacks the layers that own buffers, so the disk tier needs one layout for all of
    them with K and V alike; models with per-layer or MLA layouts (K and V heads differ) use
    the host tier only.
    """
    layouts = list(spec.layers_by_layout())
    if len(layouts) != 1 or (layouts[0].k_heads, layouts[0].k_head_dim) != (layouts[0].v_heads, layouts[0].v_head_dim):
        raise ValueError("the disk KV tier (--kv-disk-cache) needs every layer's K and V in one layout; this model's "
                         f"layouts differ ({len(layouts)} layer layouts, K vs V {layouts[0]}): use the host tier "
                         "(--kv-offloading-size) only")
    block = spec.kv_format.buffer_shape(1, spec.block_size, layouts[0].k_heads, layouts[0].k_head_dim)[1:]
    return (len(spec.owner_layers), *block)


def _warn_if_disk_is_small(disk: Any, cap_bytes: int) -> None:
    """A size cap beyond the free space is allowed (a full disk degrades to recompute), but said."""
    try:
        free = shutil.disk_usage(disk.dir).free
    except OSError:
        return
    if cap_bytes > free:
        log.warning("disk KV cache: the size cap (%.1f GiB) exceeds the free space at %s (%.1f GiB); "
                    "once the disk is full, blocks are recomputed", cap_bytes / 2**30, disk.dir, free / 2**30)
