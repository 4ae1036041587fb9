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
    """Static shared memory of ``attention_kernel`` (fp32 q, padded K, V, P, 3 row stats, and
    the tile's int32 cache blocks and offsets)."""
    return 4 * (rows * head_dim + tile * (head_dim + 1) + tile * head_dim + rows * tile + 3 * rows) + 8 * tile


#: Largest partition (keys per block) the decode kernel keeps scores for, and its K tile.
MAX_DECODE_PARTITION = 512
DECODE_KEY_TILE = 32


def score_chunks(head_dim: int, group: int, key_tile: int, threads: int) -> int:
    """Threads that share one (key, head) dot product in the decode kernel's score pass:
    enough that a tile's work items fill the block, and a divisor of ``head_dim``."""
    chunks = max(1, threads // (key_tile * group))
    while head_dim % chunks:
        chunks -= 1
    return chunks


def decode_shared_bytes(group: int, head_dim: int, key_tile: int, partition: int, threads: int) -> int:
    """Static shared memory of ``decode_kernels.decode_kernel``: fp32 q, padded K tile, the
    partition's scores, its int32 blocks and offsets, reduction scratch and head stats."""
    chunks = score_chunks(head_dim, group, key_tile, threads)
    slices = threads // head_dim
    floats = (group * head_dim + key_tile * (head_dim + 1) + group * partition + threads
              + (key_tile * group * chunks if chunks > 1 else 1) + (slices * group * head_dim if slices > 1 else 1)
              + 2 * group)
    return 4 * floats + 8 * partition


def choose_decode_tiles(group: int, head_dim: int, threads: int, key_tile: int | None = None) -> tuple[int, int]:
    """``(key_tile, max_partition)`` for the decode kernel whose shared memory fits: the
    longest partition (a power of two up to ``MAX_DECODE_PARTITION``) with a K tile of at
    least 16 keys and a partition of at least 128 where one fits (tiles of ``DECODE_KEY_TILE``
    first), else the longest that fits at all. ``key_tile`` fixes the tile."""
    def fits(tile: int, partition: int) -> bool:
        return decode_shared_bytes(group, head_dim, tile, partition, threads) <= SHARED_BUDGET_BYTES

    tiles = [key_tile] if key_tile else [DECODE_KEY_TILE, 16, 8, 4, 2, 1]
    partitions = [MAX_DECODE_PARTITION >> k for k in range(MAX_DECODE_PARTITION.bit_length())]
    preferred = [(t, p) for p in partitions if p >= 128 for t in tiles if t >= min(16, tiles[0])]
    for tile, partition in preferred + [(t, p) for p in partitions for t in tiles]:
        partition = max(partition, tile)
        if partition % tile == 0 and fits(tile, partition):
            return tile, partition
    raise ValueError(f"head_dim {head_dim} with {group} heads per kv head does not fit the decode kernel's "
                     "shared memory")


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
                  num_splits: int | None = None, max_partition: int | None = None) -> tuple[int, int]:
    """``(num_splits, partition_tokens)`` for decode.

    ``num_blocks`` is ``num_decode_seqs * num_kv_heads``; ``max_context`` the longest key
    range any decode block reads. ``partition_tokens`` is a multiple of ``tile`` and
    ``num_splits * partition_tokens >= max_context``. With ``num_splits=None`` enough
    splits are used to give every SM ``BLOCKS_PER_SM_TARGET`` blocks, without chunks
    shorter than ``MIN_PARTITION_TOKENS``. ``max_partition`` (a multiple of ``tile``) caps
    ``partition_tokens``, adding splits where the context needs them.
    """
    max_context = max(1, int(max_context))
    if num_splits is None:
        wanted = -(-(BLOCKS_PER_SM_TARGET * num_sms) // max(1, num_blocks))
        num_splits = max(1, min(wanted, max_context // MIN_PARTITION_TOKENS))
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    partition = -(-max_context // num_splits)
    partition = -(-partition // tile) * tile
    if max_partition is not None:
        partition = min(partition, max_partition)
    return -(-max_context // partition), partition
