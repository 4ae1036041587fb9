"""Prefill and chunk attention by gathering paged K/V into torch's SDPA (any device).

For the sequences of a step from ``first_seq`` on (the prefills and chunks after the leading
decodes), each sequence's context is gathered from the paged caches ``[num_blocks,
block_size, H_kv, D]`` by its block table into a dense ``[B, H_kv, S, D]`` tensor, and
``torch.nn.functional.scaled_dot_product_attention`` attends to it; on a GPU that is a
flash / memory-efficient kernel for every dtype torch has, bfloat16 included. The semantics
are :func:`kvpage.attention.reference.paged_attention_reference`'s (absolute positions,
causal, sliding window, GQA); softcap, sinks, ALiBi, chunked attention and quantized caches
are not served (:func:`sdpa_unsupported` says why), and the caller keeps another kernel.

Sequences of one (query length, context length) shape share one SDPA call. All lengths come
from host numpy metadata, so nothing is read back from the device; the host work (grouping,
index arrays, one host-to-device copy) is done once per step by :func:`plan_prefill` and the
plan serves every layer::

    one sequence, context L, query length n, window W (0: none):
    key positions   0 ........ lo ............ L-n ........... L-1
                    | unseen   | gathered: S = L - lo keys              |
    query rows                                 | n rows, positions L-n+i |
    lo = max(0, L - n + 1 - W) with a window (keys before it are out of every row's window)
    row i sees key j iff  lo <= j <= L-n+i  and (no window or j > L-n+i-W)

A shape whose visibility is plain square causality (no earlier context, the window wider
than the query) runs with ``is_causal=True`` and ``enable_gqa=True`` (flash on a GPU); any
other runs with a boolean mask, the GQA group folded into the query rows (``[B, H_kv, g*n,
D]``), so torch's masked kernels never need K/V heads expanded.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

import numpy as np
import torch
import torch.nn.functional as F

from kvpage.core.kv_formats import CacheFormat


def sdpa_unsupported(softcap: Optional[float] = None, sinks: Any = None,
                     cache_format: Optional[CacheFormat] = None, attention_chunk: Optional[int] = None,
                     alibi_slopes: Any = None) -> Optional[str]:
    """Why :func:`gather_sdpa_prefill` cannot serve a call with these arguments (None: it can).
    SDPA's score is ``q . k * scale`` under a mask: it has no softcap on the score, no
    sink term in the denominator, no per-head bias, and gathers values (never codes)."""
    if cache_format is not None and cache_format.quantized:
        return f"kv_cache_dtype {cache_format.kv_format.name} caches stay on the dequantizing kernels"
    if softcap:
        return "SDPA cannot apply a softcap to the scores"
    if sinks is not None:
        return "SDPA cannot add attention sinks to the softmax denominator"
    if attention_chunk:
        return "chunked attention is not implemented here"
    if alibi_slopes is not None:
        return "ALiBi slopes are not implemented here"
    return None


@dataclass(frozen=True, slots=True)
class ShapeGroup:
    """The sequences of one shape: each has ``q_len`` query tokens ending a context of
    ``seq_len`` tokens (query included)."""

    q_len: int
    seq_len: int
    num_seqs: int
    rows: Union[slice, torch.Tensor]  # their query rows, counted from the plan's first row (B * q_len)
    block_ids: torch.Tensor  # int64 [num_seqs, ceil(seq_len / block_size)] on the device


@dataclass(frozen=True, slots=True)
class PrefillPlan:
    """One step's prefill sequences grouped by shape (host work done once, for every layer).

    Rows ``[first_row, first_row + num_rows)`` of q are the planned sequences' rows; sequences
    with no query rows have no group."""

    first_row: int
    num_rows: int
    block_size: int  # tokens per block of the caches the plan reads
    groups: tuple[ShapeGroup, ...]


def plan_prefill(query_start_loc: np.ndarray, seq_lens: np.ndarray, block_tables: np.ndarray, block_size: int,
                 first_seq: int, device: Union[str, torch.device]) -> PrefillPlan:
    """The plan of sequences ``first_seq..`` from host metadata (``StepMetadata``'s arrays):
    int32/int64 ``query_start_loc [B + 1]``, ``seq_lens [B]`` (tokens, query included),
    ``block_tables [B, max_blocks]``. One host-to-device copy carries every index array."""
    qsl = np.asarray(query_start_loc, dtype=np.int64)
    lens, block_tables = np.asarray(seq_lens, dtype=np.int64)[first_seq:], np.asarray(block_tables)
    starts, q_lens = qsl[first_seq:-1] - qsl[first_seq], np.diff(qsl[first_seq:])
    if (lens < q_lens).any():
        raise ValueError("seq_lens must be >= each sequence's query length")
    shapes, inverse = np.unique(np.stack([q_lens, lens], axis=1), axis=0, return_inverse=True)
    parts, specs = [], []  # host index arrays; per group (q_len, seq_len, num_seqs, rows: a slice, or None: indexed)
    for g, (q_len, seq_len) in enumerate(shapes.tolist()):
        if q_len == 0:
            continue
        seqs = np.flatnonzero(inverse.reshape(-1) == g)
        rows = (starts[seqs][:, None] + np.arange(q_len)).reshape(-1)
        contiguous = bool((np.diff(rows) == 1).all())
        tables = _tables(block_tables, seqs + first_seq, -(-seq_len // block_size))
        parts += [tables.reshape(-1)] + ([] if contiguous else [rows])
        specs.append((q_len, seq_len, seqs.size, slice(int(rows[0]), int(rows[-1]) + 1) if contiguous else None))
    flat = torch.as_tensor(np.concatenate(parts) if parts else np.zeros(0, np.int64)).to(device, non_blocking=True)
    groups, at = [], 0
    for q_len, seq_len, count, rows in specs:
        size = count * -(-seq_len // block_size)
        block_ids, at = flat[at:at + size].view(count, -1), at + size
        if rows is None:
            rows, at = flat[at:at + count * q_len], at + count * q_len
        groups.append(ShapeGroup(q_len, seq_len, count, rows, block_ids))
    return PrefillPlan(int(qsl[first_seq]), int(qsl[-1] - qsl[first_seq]), block_size, tuple(groups))


def _tables(block_tables: np.ndarray, seqs: np.ndarray, num_blocks: int) -> np.ndarray:
    """int64 ``[len(seqs), num_blocks]``: the first ``num_blocks`` entries of each row."""
    if block_tables.shape[1] < num_blocks:
        raise ValueError(f"block_tables has {block_tables.shape[1]} columns; a context needs {num_blocks} blocks")
    return np.asarray(block_tables[seqs, :num_blocks], dtype=np.int64)


def gather_sdpa_prefill(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        query_start_loc: np.ndarray, seq_lens: np.ndarray, block_tables: np.ndarray, scaling: float,
                        sliding_window: Optional[int] = None, softcap: Optional[float] = None, sinks: Any = None,
                        first_seq: int = 0, *, plan: Optional[PrefillPlan] = None,
                        out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Paged attention of sequences ``first_seq..`` through SDPA: ``[T', H, D]`` in q's dtype,
    the rows ``query_start_loc[first_seq]..T`` of the contract's ``[T, H, D]`` output.

    ``q`` ``[T, H, D]`` and the caches ``[num_blocks, block_size, H_kv, D]`` (one device, one
    float dtype); the metadata is host numpy (``StepMetadata``'s), never read from the device.
    ``plan``: :func:`plan_prefill` of the same metadata, to reuse across layers (built here
    when None). ``out``: a ``[T', H, D]`` tensor to write into (allocated when None).
    Raises ``ValueError`` for softcap or sinks (:func:`sdpa_unsupported`): call another
    kernel for those layers.
    """
    reason = sdpa_unsupported(softcap, sinks)
    if reason:
        raise ValueError(f"gather-SDPA prefill cannot serve this call: {reason}")
    if key_cache.shape != value_cache.shape or key_cache.dim() != 4 or key_cache.shape[3] != q.shape[2]:
        raise ValueError(f"expected two equal caches [N, B, H_kv, {q.shape[2]}], got {tuple(key_cache.shape)} "
                         f"and {tuple(value_cache.shape)}")
    if q.shape[1] % key_cache.shape[2]:
        raise ValueError(f"num_heads ({q.shape[1]}) must be a multiple of num_kv_heads ({key_cache.shape[2]})")
    if plan is None:
        plan = plan_prefill(query_start_loc, seq_lens, block_tables, int(key_cache.shape[1]), first_seq, q.device)
    return run_prefill_plan(plan, q, key_cache, value_cache, scaling, sliding_window, out=out)


def run_prefill_plan(plan: PrefillPlan, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     scaling: float, sliding_window: Optional[int] = None, *,
                     out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:func:`gather_sdpa_prefill` of a plan whose calls were already checked: one SDPA call
    per shape group; returns ``out`` (``[plan.num_rows, H, D]``)."""
    if plan.first_row + plan.num_rows != q.shape[0] or key_cache.shape[1] != plan.block_size:
        raise ValueError(f"the plan covers rows {plan.first_row}..{plan.first_row + plan.num_rows} of blocks of "
                         f"{plan.block_size}; q has {q.shape[0]} rows, the caches blocks of {key_cache.shape[1]}")
    rows_q = q[plan.first_row:]
    if out is None:
        out = q.new_empty((plan.num_rows, *q.shape[1:]))
    window = int(sliding_window or 0)
    for group in plan.groups:
        out[group.rows] = _attend_group(group, rows_q[group.rows], key_cache, value_cache, plan.block_size,
                                        scaling, window)
    return out


def _gather_keys(cache: torch.Tensor, block_ids: torch.Tensor, block_size: int, lo: int, seq_len: int) -> torch.Tensor:
    """Key positions ``[lo, seq_len)`` of each sequence, ``[B, H_kv, seq_len - lo, D]`` (a view
    of one gathered copy of the blocks that hold them)."""
    first_block = lo // block_size
    blocks = cache[block_ids[:, first_block:]]  # [B, nb, block_size, H_kv, D]
    skip = lo - first_block * block_size
    rows = blocks.flatten(1, 2)[:, skip:skip + seq_len - lo]
    return rows.transpose(1, 2)


def _attend_group(group: ShapeGroup, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                  block_size: int, scaling: float, window: int) -> torch.Tensor:
    """One SDPA call over a shape group: ``q`` ``[B * n, H, D]`` to ``[B * n, H, D]``."""
    n, L, batch = group.q_len, group.seq_len, group.num_seqs
    lo = max(0, L - n + 1 - window) if window else 0
    keys = _gather_keys(key_cache, group.block_ids, block_size, lo, L)
    values = _gather_keys(value_cache, group.block_ids, block_size, lo, L)
    heads, kv_heads, dim = q.shape[1], keys.shape[1], q.shape[2]
    q = q.reshape(batch, n, heads, dim)
    if n == 1 or (L - lo == n and (not window or window >= n)):  # every key visible, or square causal
        o = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, is_causal=n > 1, scale=scaling,
                                           enable_gqa=heads != kv_heads)
        return o.transpose(1, 2).reshape(batch * n, heads, dim)
    group_size = heads // kv_heads
    folded = q.reshape(batch, n, kv_heads, group_size, dim).permute(0, 2, 3, 1, 4).reshape(batch, kv_heads, -1, dim)
    mask = _visible(n, L, lo, window, q.device).repeat(group_size, 1)  # row r: query r % n
    o = F.scaled_dot_product_attention(folded, keys, values, attn_mask=mask, scale=scaling)
    o = o.reshape(batch, kv_heads, group_size, n, dim).permute(0, 3, 1, 2, 4)
    return o.reshape(batch * n, heads, dim)


def _visible(q_len: int, seq_len: int, lo: int, window: int, device: torch.device) -> torch.Tensor:
    """bool ``[q_len, seq_len - lo]``: key ``lo + j`` visible from query position ``seq_len - q_len + i``."""
    q_pos = torch.arange(seq_len - q_len, seq_len, device=device)[:, None]
    k_pos = torch.arange(lo, seq_len, device=device)[None, :]
    visible = k_pos <= q_pos
    if window:
        visible &= k_pos > q_pos - window
    return visible
