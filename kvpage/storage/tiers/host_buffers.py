"""The host tier's memory, and the byte copies between it and the pool's buffers.

Per layer that owns buffers one K and one V tensor ``[num_slots, block_size, heads, head_dim]`` in
the pool's dtype (``[num_slots, block_bytes]`` uint8 for a quantized KV format, codes and scales
moving together): host slot ``s`` holds one block, the same layout as pool block ``b``
(``kvpage.storage.paged_cache``). When the pool is on a GPU the host tensors are pinned. Every copy
is one gather and one scatter per layer and buffer, over all the step's blocks at once.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from kvpage.storage.paged_cache import PagedKVCache


class HostKVBuffers:
    """``num_slots`` host blocks shaped like ``kv_cache``'s blocks (memory is committed lazily)."""

    def __init__(self, kv_cache: PagedKVCache, num_slots: int) -> None:
        import torch

        # Layers that reuse another layer's KV have no buffers of their own: nothing to copy.
        layers = kv_cache.spec.owner_layers
        self.pool = [kv_cache.torch_key_cache(i) for i in layers] + [kv_cache.torch_value_cache(i) for i in layers]
        self.device = self.pool[0].device
        self.num_slots = num_slots
        self.num_layers = len(layers)
        self.bytes_per_block = kv_cache.spec.bytes_per_block
        pin = self.device.type == "cuda"
        # empty, not zeros: a large tier should not touch every page at start-up. Each host
        # tensor takes its pool buffer's shape (K and V, and layers, may differ).
        self.host = [torch.empty((num_slots, *buf.shape[1:]), dtype=buf.dtype, pin_memory=pin) for buf in self.pool]

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.bytes_per_block

    def store(self, pairs: np.ndarray) -> None:
        """Host slot ``pairs[i, 1]`` := pool block ``pairs[i, 0]`` (slots distinct)."""
        import torch

        blocks = torch.from_numpy(np.ascontiguousarray(pairs[:, 0])).to(self.device)
        slots = torch.from_numpy(np.ascontiguousarray(pairs[:, 1]))
        for pool, host in zip(self.pool, self.host):
            host.index_copy_(0, slots, pool.index_select(0, blocks).to("cpu"))

    def load(self, pairs: np.ndarray) -> None:
        """Pool block ``pairs[i, 1]`` := host slot ``pairs[i, 0]`` (blocks distinct)."""
        import torch

        slots = torch.from_numpy(np.ascontiguousarray(pairs[:, 0]))
        blocks = torch.from_numpy(np.ascontiguousarray(pairs[:, 1])).to(self.device)
        for pool, host in zip(self.pool, self.host):
            pool.index_copy_(0, blocks, host.index_select(0, slots).to(self.device, non_blocking=True))

    def gather_pool(self, block_ids: list[int]) -> tuple[Any, Any]:
        """Copies of pool blocks ``block_ids`` as (key, value), each ``[n, layers, block_size,
        heads, head_dim]`` on the CPU: a snapshot that later steps cannot overwrite."""
        import torch

        index = torch.as_tensor(block_ids, dtype=torch.long, device=self.device)
        parts = [buf.index_select(0, index).to("cpu") for buf in self.pool]
        return torch.stack(parts[: self.num_layers], dim=1), torch.stack(parts[self.num_layers:], dim=1)

    def write_slot(self, slot: int, key: Any, value: Any) -> None:
        """Host slot ``slot`` := one block's (key, value), each ``[layers, block_size, heads, head_dim]``."""
        for layer in range(self.num_layers):
            self.host[layer][slot].copy_(key[layer])
            self.host[self.num_layers + layer][slot].copy_(value[layer])
