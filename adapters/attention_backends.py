"""Attention backends the HF adapter can run on, behind one small protocol.

``ReferenceBackend`` runs the numpy oracle (slow; for checking). ``select_backend``
picks the fast path for the KV buffers' device.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from kvpage.attention.reference import paged_attention_reference


@dataclass(slots=True)
class PreparedIndices:
    """Per-step index tensors, built once per step and shared by every layer."""

    slot_mapping: torch.Tensor  # int64 [T]
    query_start_loc: np.ndarray  # int64 [B + 1]
    seq_lens: np.ndarray  # int64 [B]
    block_tables: np.ndarray  # int32 [B, max_blocks]
    num_decodes: int


def prepare_indices(metadata: Any, device: torch.device) -> PreparedIndices:
    return PreparedIndices(
        slot_mapping=torch.as_tensor(metadata.slot_mapping, dtype=torch.int64, device=device),
        query_start_loc=np.asarray(metadata.query_start_loc, dtype=np.int64),
        seq_lens=np.asarray(metadata.seq_lens, dtype=np.int64),
        block_tables=np.asarray(metadata.block_tables),
        num_decodes=int(metadata.num_decodes),
    )


def scatter_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               slot_mapping: torch.Tensor) -> None:
    """Write ``k``/``v`` ``[T, H_kv, D]`` into flat slots of ``[num_blocks, block_size, H_kv, D]`` buffers."""
    key_cache.view(-1, *key_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(key_cache.dtype))
    value_cache.view(-1, *value_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(value_cache.dtype))


class ReferenceBackend:
    """The numpy reference, through float32 copies. Exact semantics, no speed."""

    name = "reference"

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def prepare(self, metadata: Any) -> PreparedIndices:
        return prepare_indices(metadata, self.device)

    def write_kv(self, key_cache, value_cache, k, v, prepared: PreparedIndices) -> None:
        scatter_kv(key_cache, value_cache, k, v, prepared.slot_mapping)

    def attention(self, q, key_cache, value_cache, prepared: PreparedIndices, scaling: float,
                  sliding_window: Optional[int], softcap: Optional[float], sinks: Optional[torch.Tensor]):
        as_np = lambda t: t.detach().float().cpu().numpy()  # noqa: E731
        out = paged_attention_reference(
            as_np(q), as_np(key_cache), as_np(value_cache), prepared.query_start_loc, prepared.seq_lens,
            prepared.block_tables, scaling, sliding_window, softcap, None if sinks is None else as_np(sinks),
        )
        return torch.from_numpy(out).to(device=q.device, dtype=q.dtype)


def select_backend(name: str, device: torch.device):
    """Backend by name: ``"auto"``, ``"reference"`` (more as they land)."""
    if name in ("auto", "reference"):
        return ReferenceBackend(device)
    raise ValueError(f"unknown attention backend {name!r}; expected 'auto' or 'reference'")
