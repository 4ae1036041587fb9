"""Launch-shape choices for the attention kernels: tile size, rows per block, split-K.

Pure arithmetic (no numba import), so it is unit-testable anywhere.
"""
from __future__ import annotations

# Numba's static shared memory is capped at 48 KiB per block; keep a margin.
SHARED_BUDGET_BYTES = 46 * 1024
MAX_TILE = 64
# Split-K never cuts a sequence into chunks shorter than this (merge overhead dominates).
MIN_PARTITION_TOKENS = 256
# Aim for this many resident blocks per SM when choosing the number of splits.
BLOCKS_PER_SM_TARGET = 4


def shared_bytes(rows: int, head_dim: int, tile: int) -> int:
    """Static shared memory of ``attention_kernel`` (fp32 q, padded K, V, P and 3 row stats)."""
    return 4 * (rows * head_dim + tile * (head_dim + 1) + tile * head_dim + rows * tile + 3 * rows)


def choose_tile(rows: int, head_dim: int, max_tile: int = MAX_TILE) -> int:
    """Largest power-of-two key tile (<= ``max_tile``) whose shared memory fits the budget."""
    tile = 1
    while tile * 2 <= max_tile and shared_bytes(rows, head_dim, tile * 2) <= SHARED_BUDGET_BYTES:
        tile *= 2
    if shared_bytes(rows, head_dim, tile) > SHARED_BUDGET_BYTES:
        raise ValueError(f"head_dim {head_dim} with {rows} rows per block does not fit in shared memory")
    return tile


def prefill_rows(group: int, target: int = 16) -> int:
    """Rows per prefill block: whole query tokens (a multiple of ``group``), about ``target``."""
    return group * max(1, target // group)


def choose_splits(num_blocks: int, max_context: int, tile: int, num_sms: int,
                  num_splits: int | None = None) -> tuple[int, int]:
    """``(num_splits, partition_tokens)`` for decode.

    ``num_blocks`` is ``num_decode_seqs * num_kv_heads``; ``max_context`` the longest key
    range any decode block reads. ``partition_tokens`` is a multiple of ``tile`` and
    ``num_splits * partition_tokens >= max_context``. With ``num_splits=None`` enough
    splits are used to give every SM ``BLOCKS_PER_SM_TARGET`` blocks, without chunks
    shorter than ``MIN_PARTITION_TOKENS``.
    """
    max_context = max(1, int(max_context))
    if num_splits is None:
        wanted = -(-(BLOCKS_PER_SM_TARGET * num_sms) // max(1, num_blocks))
        num_splits = max(1, min(wanted, max_context // MIN_PARTITION_TOKENS))
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    partition = -(-max_context // num_splits)
    partition = -(-partition // tile) * tile
    return -(-max_context // partition), partition
