"""Launch shapes of the fast decode kernel (``decode_fast.fast_decode_kernel``).

Pure arithmetic (no numba import), so it is unit-testable anywhere. The kernel runs
``FAST_THREADS`` threads per block; the split count comes from the device's SM count so
the grid fills it several times over (``fast_decode_splits``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

#: Threads per block of the fast kernel: 4 warps, each walking its own keys.
FAST_THREADS = 128
#: Resident blocks per SM each GQA group size is sized for (``register_budget``): a lane keeps
#: 8 query elements and 8 accumulators per head in registers, so larger groups fit fewer blocks.
#: group 1: <= 128 registers (4 blocks), 4: <= 168 (3), 8: <= 255 (2); every block has 4 warps,
#: each with 4 KiB of K/V loads in flight per iteration (8-bit KV at groups 4 and 8: 2 KiB, see
#: ``FAST_UNROLL``). The 8-bit variants keep the same budgets, so the same split sizing.
FAST_BLOCKS_PER_SM = {1: 4, 4: 3, 8: 2}
#: The grid is at least this many full waves (``sm_count * blocks_per_sm`` blocks each) when the
#: context is long enough, so the last, partly filled wave is a small share of the run time.
MIN_WAVES = 2
#: Split-K never cuts a context into partitions shorter than this (keys): below it the
#: partial writes and the merge cost more than the parallelism they buy.
FAST_MIN_PARTITION = 256
#: Most splits per (sequence, kv head): the block that merges reads every split's partials, and
#: its shared memory holds one weight per split and head.
FAST_MAX_SPLITS = 64
#: head_dim, group and KV dtypes the fast kernel is compiled for: 16-bit caches, and the
#: quantized formats (``kvpage.core.kv_formats`` names; q and out are fp16 for those).
FAST_HEAD_DIMS = (64, 128)
FAST_GROUPS = (1, 4, 8)
FAST_KV_DTYPES = ("fp16", "bf16")
FAST_QUANT_DTYPES = ("int8", "fp8_e4m3", "fp8_e5m2", "int4")
#: Warp steps per iteration (each step: one key per ``head_dim / 8`` lanes), i.e. the K and V
#: loads each lane has in flight before it uses any: 16-bit rows 4 steps of 16 bytes (4 KiB
#: per warp and iteration). 8-bit rows load half the bytes a step, so groups 1 and 4 take 8
#: steps (the same 4 KiB in flight); group 8 has no registers left for more than 4. int4 rows
#: (a code and a scale load a step) take the 8-bit steps.
FAST_UNROLL = {"16bit": {1: 4, 4: 4, 8: 4}, "8bit": {1: 8, 4: 4, 8: 4}}


@dataclass(frozen=True, slots=True)
class FastSplits:
    """Split-K shape of one decode launch: ``num_splits`` partitions of ``partition`` keys.

    ``partition`` is a multiple of the block size and ``num_splits * partition >= context``
    with ``(num_splits - 1) * partition < context``: every key of the longest context falls
    in exactly one split (shorter contexts leave their last splits empty).
    """

    num_splits: int
    partition: int


def register_budget(group: int, threads: int = FAST_THREADS) -> int:
    """Most registers per thread that still keep ``FAST_BLOCKS_PER_SM[group]`` blocks resident on
    an SM with 65536 registers (allocation granularity: 8 per thread; at most 255)."""
    return min(255, (65536 // (threads * FAST_BLOCKS_PER_SM[group])) // 8 * 8)


def fast_supported(head_dim: int, group: int, kv_dtype: str) -> bool:
    """Whether a compiled fast variant exists for this shape (else use the reference kernel)."""
    return (head_dim in FAST_HEAD_DIMS and group in FAST_GROUPS
            and (kv_dtype in FAST_KV_DTYPES or kv_dtype in FAST_QUANT_DTYPES))


def fast_unroll(group: int, kv_dtype: str) -> int:
    """Warp steps per iteration of the ``(group, kv_dtype)`` variant (``FAST_UNROLL``)."""
    return FAST_UNROLL["8bit" if kv_dtype in FAST_QUANT_DTYPES else "16bit"][group]


def fixed_splits(context: int, splits: int, block_size: int) -> FastSplits:
    """About ``splits`` (clamped to ``1..FAST_MAX_SPLITS``) equal partitions of ``context`` keys,
    each a whole number of blocks (fewer splits when rounding up leaves the last ones empty)."""
    context, block_size = max(1, int(context)), max(1, int(block_size))
    splits = min(FAST_MAX_SPLITS, max(1, int(splits)))
    partition = -(-context // splits)
    partition = -(-partition // block_size) * block_size
    return FastSplits(-(-context // partition), partition)


def fast_decode_splits(num_seqs: int, num_kv_heads: int, context: int, sm_count: int, block_size: int,
                       blocks_per_sm: int = 3) -> FastSplits:
    """Split-K shape for ``num_seqs`` decodes over ``num_kv_heads`` with longest ``context`` keys.

    The grid is ``(num_seqs, num_kv_heads, num_splits)`` and one wave is ``sm_count *
    blocks_per_sm`` blocks. Without splitting a grid of at least ``MIN_WAVES`` waves stays at
    one split. Otherwise the candidates run from the fewest splits giving ``MIN_WAVES`` waves
    up to twice that, limited by partitions of ``FAST_MIN_PARTITION`` keys and by
    ``FAST_MAX_SPLITS``; the one whose last wave is fullest wins (ties: fewer splits).
    ``blocks_per_sm``: ``FAST_BLOCKS_PER_SM[group]`` of the variant launched.
    """
    context = max(1, int(context))
    block_size = max(1, int(block_size))
    groups = max(1, num_seqs * num_kv_heads)
    wave = max(1, sm_count * blocks_per_sm)
    need = -(-MIN_WAVES * wave // groups)
    most = max(1, min(FAST_MAX_SPLITS, context // FAST_MIN_PARTITION))
    if need <= 1 or most == 1:
        return fixed_splits(context, 1, block_size)
    best, best_fill = None, -1.0
    for splits in range(min(need, most), min(2 * need, most) + 1):
        shape = fixed_splits(context, splits, block_size)
        blocks = groups * shape.num_splits
        fill = blocks / (-(-blocks // wave) * wave)
        if fill > best_fill + 1e-9:
            best, best_fill = shape, fill
    return best


def split_ranges(context: int, window: int, splits: FastSplits) -> list[tuple[int, int]]:
    """``[begin, end)`` keys of each split for one sequence, as the kernel derives them: a
    window ``W > 0`` starts the range at ``max(0, context - W)``; empty splits give ``begin >= end``."""
    lo = max(0, context - window) if window > 0 else 0
    return [(lo + s * splits.partition, min(context, lo + (s + 1) * splits.partition))
            for s in range(splits.num_splits)]


@dataclass(frozen=True, slots=True)
class FastScratch:
    """Buffers of one fast decode launch (allocate in the arrays' library, on the launch stream).

    ``part_max``/``part_sum`` fp32 ``[num_tokens, num_heads, num_splits]``, ``part_acc`` fp32
    ``[num_tokens, num_heads, num_splits, head_dim]`` (any contents), ``counters`` int32
    ``[num_seqs, num_kv_heads]``, zero before the first launch and left zero by every launch (so
    one zeroed buffer can be kept and reused, also inside a CUDA graph). ``sinks`` fp32: the
    per-head sinks, or any 1-element array when there are none.
    """

    part_max: object
    part_sum: object
    part_acc: object
    counters: object
    sinks: object


def scratch_shapes(num_tokens: int, num_heads: int, head_dim: int, num_seqs: int, num_kv_heads: int,
                   splits: FastSplits) -> dict[str, tuple[int, ...]]:
    """Shapes of ``FastScratch``'s partial buffers and counters (a single split still needs
    1-element-per-axis buffers of the right rank: the variant's signature is fixed)."""
    s = splits.num_splits
    return {"part_max": (num_tokens, num_heads, s), "part_sum": (num_tokens, num_heads, s),
            "part_acc": (num_tokens, num_heads, s, head_dim), "counters": (num_seqs, num_kv_heads)}


def launch_fast_decode(kernel, bits: tuple, metadata: tuple, scaling: float, window: int, softcap: float,
                       has_sinks: bool, splits: FastSplits, out_bits, scratch: FastScratch, stream=0,
                       num_kv_heads: Optional[int] = None) -> None:
    """Launch ``decode_fast.fast_decode_kernel`` over ``metadata = (query_start_loc, seq_lens,
    block_tables)`` (int32, one decode per sequence) and ``bits = (q, key_cache, value_cache)``
    (q as 32-bit words; the caches as 32-bit words ``[N, B, H_kv, D/2]``, or a quantized
    format's uint8 ``[N, block_bytes]`` buffers, which need ``num_kv_heads``); writes
    ``out_bits`` (16-bit words of ``[T, H, D]``). ``window`` 0 and ``softcap`` 0.0 mean none.
    With one split the kernel writes ``out`` directly; otherwise it writes partials and its
    last block per (sequence, kv head) merges them (no second launch).
    """
    if splits.num_splits > FAST_MAX_SPLITS:
        raise ValueError(f"{splits.num_splits} splits exceed FAST_MAX_SPLITS ({FAST_MAX_SPLITS})")
    if num_kv_heads is None:
        num_kv_heads = int(bits[1].shape[2])
    num_seqs = int(metadata[1].shape[0])
    grid = (num_seqs, int(num_kv_heads), splits.num_splits)
    kernel[grid, FAST_THREADS, stream](*bits, *metadata, float(scaling), int(window), float(softcap), scratch.sinks,
                                       int(has_sinks), splits.partition, int(splits.num_splits > 1), out_bits,
                                       scratch.part_max, scratch.part_sum, scratch.part_acc, scratch.counters)
