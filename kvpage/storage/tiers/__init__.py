"""The lower KV tiers' bytes: host memory and the persistent disk cache (runner side).

The core (``kvpage.core.offload.kv_offload``) decides what moves; this package owns the memory and
files and moves the bytes when the engine hands it a step's plan:

    host_buffers.py   the host tier's tensors, and the copies to and from the pool's buffers
    disk_store.py     one safetensors file per block, atomic writes, checksummed reads
    fingerprint.py    the model/dtype/block-size fingerprint that keys the disk folder
    agent.py          ``KVTierAgent``: runs each step's copies; disk I/O on two threads
    histogram.py      transfer latency histograms for ``stats()`` and ``/metrics``

``attach_kv_tiers`` wires it into an engine whose scheduler has tiers (imports torch).
"""
from __future__ import annotations

import logging
import shutil
from typing import Any

from kvpage.core.config import EngineConfig
from kvpage.storage.kv_storage import KVCacheSpec, PagedKVCache, free_ram_bytes

log = logging.getLogger("kvpage")


def attach_kv_tiers(engine: Any, config: EngineConfig, spec: KVCacheSpec, kv_cache: PagedKVCache,
                    model: Any) -> None:
    """Give ``engine`` a ``KVTierAgent`` for its scheduler's tiers (a no-op without tiers).

    Opens the disk folder (a folder that cannot be written makes a read-only tier, one that
    cannot be read an empty one, each with a warning), indexes the blocks it holds and
    deletes those past the size cap.
    """
    from kvpage.storage.tiers.agent import KVTierAgent
    from kvpage.storage.tiers.disk_store import DiskKVStore
    from kvpage.storage.tiers.fingerprint import model_fingerprint

    offload = engine.scheduler.offload
    if offload is None:
        return
    host_bytes, free_ram = offload.host.num_slots * spec.bytes_per_block, free_ram_bytes()
    if host_bytes > free_ram:
        raise ValueError(f"the host KV tier needs {host_bytes / 2**30:.2f} GiB (kv_offloading_size) but only "
                         f"{free_ram / 2**30:.2f} GiB of RAM is available")
    disk, writable = None, False
    if offload.disk is not None and config.kv_disk_cache:
        block_shape = disk_block_shape(spec)
        disk = DiskKVStore(config.kv_disk_cache, model_fingerprint(model, spec), block_shape,
                           kv_cache.torch_key_cache(0).dtype)
        writable, problem = disk.open()
        _warn_if_disk_is_small(disk, offload.disk.num_slots * spec.bytes_per_block)
        found = disk.scan(remove_leftovers=writable)
        for op in engine.scheduler.tiers.restore_disk(found, writable):
            if writable:
                disk.remove(op.block_hash)
    engine.kv_tiers = KVTierAgent(kv_cache, offload.host.num_slots, disk, writable)
    if disk is not None and problem:
        engine.kv_tiers.note_unwritable(problem)
    log.info("KV tiers: host %d blocks (%.1f MiB)%s", offload.host.num_slots,
             offload.host.num_slots * spec.bytes_per_block / 2**20,
             "" if disk is None else f", disk {offload.disk.num_slots} blocks at {disk.dir} "
             f"({len(offload.disk)} restored{'' if writable else ', read-only'})")


def disk_block_shape(spec: Any) -> tuple:
    """``[layers, block_size, heads, head_dim]`` of one block file's K (and V) tensor.

    A file stacks the layers that own buffers, so the disk tier needs one layout for all of
    them with K and V alike; models with per-layer or MLA layouts (K and V heads differ) use
    the host tier only.
    """
    layouts = list(spec.layers_by_layout())
    if len(layouts) != 1 or (layouts[0].k_heads, layouts[0].k_head_dim) != (layouts[0].v_heads, layouts[0].v_head_dim):
        raise ValueError("the disk KV tier (--kv-disk-cache) needs every layer's K and V in one layout; this model's "
                         f"layouts differ ({len(layouts)} layer layouts, K vs V {layouts[0]}): use the host tier "
                         "(--kv-offloading-size) only")
    return (len(spec.owner_layers), spec.block_size, layouts[0].k_heads, layouts[0].k_head_dim)


def _warn_if_disk_is_small(disk: Any, cap_bytes: int) -> None:
    """A size cap beyond the free space is allowed (a full disk degrades to recompute), but said."""
    try:
        free = shutil.disk_usage(disk.dir).free
    except OSError:
        return
    if cap_bytes > free:
        log.warning("disk KV cache: the size cap (%.1f GiB) exceeds the free space at %s (%.1f GiB); "
                    "once the disk is full, blocks are recomputed", cap_bytes / 2**30, disk.dir, free / 2**30)
