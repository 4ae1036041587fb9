"""The KV byte copies between the pool and the lower tiers that the core asks for.

The core decides; the layer that owns the buffers (``kvpage.storage.tiers.KVTierAgent``) copies.
Two plans per step, each executed in order:

    before the forward  (``KVTransfers``, on ``SchedulerOutput.kv_transfers``)
        1 host_stores    pool block -> host slot   blocks evicted from the pool this step;
                                                   their pool blocks may be rewritten by
                                                   steps 2-4, so they are read first
        2 host_loads     host slot -> pool block   prefix hits in the host tier
        (3 copy-on-write, 4 the forward: the model runner)
        disk_fetches     disk -> host slot         read in the background; the result comes
                                                   back through ``TierScheduling.complete_fetches``

    after a successful step  (``TierScheduling.take_saves``: a list of ``DiskOp``)
        save / remove    pool block -> disk file, disk file deleted (the disk tier's LRU)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from kvpage.core.block_hash import BlockHash


def _pairs() -> np.ndarray:
    return np.zeros((0, 2), dtype=np.int64)


@dataclass(slots=True)
class KVTransfers:
    """One step's copies before its forward.

    Attributes:
        host_stores: int64 [K, 2] (pool block, host slot); host slots are distinct.
        host_loads: int64 [L, 2] (host slot, pool block); pool blocks are distinct, and
            every slot read is pinned until the copy is done.
        disk_fetches: (block hash, host slot) reads from the disk tier into host slots
            reserved for them (pending until their completion is reported).
        store_hashes: the block hash of each ``host_stores`` row (to undo a failed step).
    """

    host_stores: np.ndarray = field(default_factory=_pairs)
    host_loads: np.ndarray = field(default_factory=_pairs)
    disk_fetches: list = field(default_factory=list)
    store_hashes: list = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not (len(self.host_stores) or len(self.host_loads) or self.disk_fetches)


@dataclass(frozen=True, slots=True)
class DiskOp:
    """One disk-tier change, in decision order: ``"save"`` writes pool block ``block_id``
    (KV of the just-finished step) under ``block_hash``; ``"remove"`` deletes its file."""

    kind: str
    block_hash: BlockHash
    block_id: Optional[int] = None
