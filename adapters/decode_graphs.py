"""Decode steps replayed from CUDA graphs: one graph per batch-size bucket.

A GPU decode step of an eager model is hundreds of kernel launches, each with its Python
and driver cost; at small batches the host, not the GPU, sets the step time. So, as vLLM
does, the runner captures the whole decode forward (every layer's KV store, attention and
the model's own ops) once per bucket of batch sizes (``capture_sizes``) at start-up, and a
decode step becomes: write the step's metadata into pinned host staging, one copy per dtype
into persistent device buffers, one ``replay``.

Contract of a replayed step (``DecodeGraphs.run``):

* Every input a graph reads lives in ``StaticDecodeBuffers``, allocated once for the largest
  bucket; a step of ``n`` sequences replays the smallest bucket ``b >= n``, and rows
  ``n..b`` are padding: token 0 at position 0, slot -1 (its K/V is not stored), context
  length 0 (its attention reads no key and yields zeros), logits dropped.
* The launches inside a graph are sized at capture, not per step: every attention call
  sees ``num_decodes = b`` and a context of ``max_seq_len`` (the engine's max model
  length), so split-K is sized for the longest context a sequence can reach, and shorter
  contexts leave their last splits empty. Block tables are ``table_width`` wide (blocks
  for ``max_seq_len``); a step whose tables are wider is not replayed.
* Backends take part through ``prepare_graphed(GraphedStepIndices)``: the per-group view of
  the persistent buffers their kernels read. A backend without it (the CPU and reference
  backends) runs every step eagerly.
* Nothing in a replayed step allocates, reads the device back or synchronises; the only
  host wait is on the previous step's staging copy (``load``), long finished by then.

Capture itself goes through a ``GraphCapture`` (``CudaGraphCapture`` on a GPU), so the
buffer and padding logic is tested on CPU with a capture that re-runs the forward.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Protocol, Sequence

import numpy as np
import torch

from kvpage.core.sched.metadata import StepMetadata

#: Buckets up to this size are powers of two; past it, multiples of it (as vLLM's sizes).
SMALL_BUCKETS = (1, 2, 4, 8)
BUCKET_STEP = 8
#: Largest batch captured by default: beyond it a decode step's launches are long enough
#: that host time hides behind them, and each bucket costs capture time and graph memory.
MAX_CAPTURE_SIZE = 256


def capture_sizes(max_num_seqs: int, limit: int = MAX_CAPTURE_SIZE) -> list[int]:
    """The batch sizes captured for an engine of ``max_num_seqs``: 1, 2, 4, 8, then every
    multiple of 8, up to ``min(max_num_seqs, limit)``, which is always the last."""
    top = max(1, min(int(max_num_seqs), int(limit)))
    sizes = [s for s in SMALL_BUCKETS if s < top]
    sizes += list(range(BUCKET_STEP * 2, top, BUCKET_STEP))
    return sorted({*sizes, top})


def bucket_for(num_seqs: int, sizes: Sequence[int]) -> Optional[int]:
    """The smallest captured size holding ``num_seqs`` sequences (None: larger than all)."""
    for size in sizes:
        if size >= num_seqs:
            return size
    return None


@dataclass(frozen=True, slots=True)
class GraphedStepIndices:
    """One KV group's indices for a replayed decode step of ``num_seqs`` rows (a bucket),
    as views of persistent device buffers that every replay re-reads: ``slot_mapping``
    int64 ``[num_seqs]``, ``query_start_loc`` int32 ``[num_seqs + 1]`` (0, 1, ...),
    ``seq_lens`` int32 ``[num_seqs]``, ``block_tables`` int32 ``[num_seqs, width]``.
    Launch sizes come from ``num_seqs`` and ``max_seq_len``, never from the values."""

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    num_seqs: int
    max_seq_len: int


class StaticDecodeBuffers:
    """Persistent inputs of every captured decode graph, for ``max_seqs`` rows and
    ``num_groups`` KV groups, with one pinned host staging copy of each.

    Two flat buffers per side, one per dtype: int64 (token ids, positions, each group's
    slots) and int32 (query starts, each group's context lengths and block tables), so a
    step's refresh is two copies whatever the model."""

    def __init__(self, max_seqs: int, num_groups: int, table_width: int, device: torch.device) -> None:
        self.max_seqs, self.num_groups, self.table_width = int(max_seqs), int(num_groups), int(table_width)
        self.device = device
        b, g, w = self.max_seqs, self.num_groups, self.table_width
        pinned = device.type == "cuda"
        self._host64 = torch.zeros((2 + g) * b, dtype=torch.int64, pin_memory=pinned)
        self._host32 = torch.zeros(b + 1 + g * b * (1 + w), dtype=torch.int32, pin_memory=pinned)
        self._dev64 = torch.zeros_like(self._host64, device=device)
        self._dev32 = torch.zeros_like(self._host32, device=device)
        self._copied = torch.cuda.Event() if pinned else None  # the staging copy in flight
        self.rows = torch.arange(b, device=device)  # every row's logits, in order
        h64, h32 = self._host64.numpy(), self._host32.numpy()
        self._host = self._layout(h64, h32)
        self._device = self._layout(self._dev64, self._dev32)
        self._host["query_start_loc"][:] = np.arange(b + 1)
        self._host["slot_mapping"][:] = -1  # no row stores K/V until a step is loaded
        self._dev64.copy_(self._host64)
        self._dev32.copy_(self._host32)

    def _layout(self, flat64, flat32) -> dict:
        """Named views of one side's two flat buffers."""
        b, g, w = self.max_seqs, self.num_groups, self.table_width
        seq_lens_end = b + 1 + g * b
        return {"input_ids": flat64[:b], "positions": flat64[b:2 * b],
                "slot_mapping": flat64[2 * b:].reshape(g, b),
                "query_start_loc": flat32[:b + 1],
                "seq_lens": flat32[b + 1:seq_lens_end].reshape(g, b),
                "block_tables": flat32[seq_lens_end:].reshape(g, b, w)}

    def inputs(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The forward's ``(input_ids, positions, rows)`` for a bucket, as device views."""
        return self._device["input_ids"][:bucket], self._device["positions"][:bucket], self.rows[:bucket]

    def indices(self, bucket: int, max_seq_len: int) -> list[GraphedStepIndices]:
        """Each KV group's ``GraphedStepIndices`` for a bucket (device views)."""
        d = self._device
        return [GraphedStepIndices(d["slot_mapping"][g, :bucket], d["query_start_loc"][:bucket + 1],
                                   d["seq_lens"][g, :bucket], d["block_tables"][g, :bucket], bucket, max_seq_len)
                for g in range(self.num_groups)]

    def fits(self, metadata: StepMetadata) -> bool:
        """Whether the step's block tables fit the buffers' width (in every group)."""
        tables = (metadata.block_tables, *metadata.group_block_tables)
        return len(tables) == self.num_groups and all(t.shape[1] <= self.table_width for t in tables)

    def load(self, metadata: StepMetadata, bucket: int) -> None:
        """Stage a decode step (``fits``; one token per sequence) for a replay of ``bucket``
        rows, padding included, and queue its copy to the device on the current stream."""
        self.stage(metadata.input_ids, metadata.positions, (metadata.slot_mapping, *metadata.group_slot_mappings),
                   metadata.seq_lens, (metadata.block_tables, *metadata.group_block_tables), bucket)

    def stage(self, input_ids: np.ndarray, positions: np.ndarray, slots: Sequence[np.ndarray],
              seq_lens: np.ndarray, tables: Sequence[np.ndarray], bucket: int) -> None:
        """``load`` from the arrays: ``slots`` and ``tables`` one per KV group."""
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has read the staging buffers
        n, h = len(input_ids), self._host
        h["input_ids"][:n] = input_ids
        h["positions"][:n] = positions
        h["input_ids"][n:bucket] = 0
        h["positions"][n:bucket] = 0
        for g, (table, slot) in enumerate(zip(tables, slots)):
            h["slot_mapping"][g, :n] = slot
            h["slot_mapping"][g, n:bucket] = -1
            h["seq_lens"][g, :n] = seq_lens
            h["seq_lens"][g, n:bucket] = 0
            h["block_tables"][g, :n, :table.shape[1]] = table
        self._dev64.copy_(self._host64, non_blocking=True)
        self._dev32.copy_(self._host32, non_blocking=True)
        if self._copied is not None:
            self._copied.record()

    def stage_probe(self, bucket: int) -> None:
        """Stage inputs unlike any a graph was captured with (tokens 1 and 2, positions 1..3,
        every row attending one key of block 0, nothing stored), for ``verify``."""
        rows = np.arange(bucket)
        slots = [np.full(bucket, -1, np.int64)] * self.num_groups
        tables = [np.zeros((bucket, 1), np.int32)] * self.num_groups
        self.stage(rows % 2 + 1, rows % 3 + 1, slots, np.ones(bucket, np.int32), tables, bucket)


class Replay(Protocol):
    def __call__(self) -> torch.Tensor:
        """Run the captured forward again on the buffers' current contents; its logits."""


class GraphCapture(Protocol):
    """How forwards are captured: ``warm_up(fn)`` runs ``fn`` as capture will (its stream,
    its pools), so that kernels compile and launch buffers grow beforehand; ``capture(fn)``
    records it and returns a ``Replay``."""

    def warm_up(self, fn: Callable[[], torch.Tensor]) -> None: ...

    def capture(self, fn: Callable[[], torch.Tensor]) -> Replay: ...


class CudaGraphCapture:
    """``torch.cuda.CUDAGraph`` capture on one side stream, all graphs in one memory pool
    (captured largest first, so the smaller ones reuse its blocks)."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device)
        self.pool = torch.cuda.graph_pool_handle()

    def warm_up(self, fn: Callable[[], torch.Tensor]) -> None:
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            fn()
        torch.cuda.current_stream().wait_stream(self.stream)
        self.stream.synchronize()

    def capture(self, fn: Callable[[], torch.Tensor]) -> Replay:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"):
            logits = fn()

        def replay() -> torch.Tensor:
            graph.replay()
            return logits

        return replay


class RerunCapture:
    """A stand-in for graph capture on CPU: a "replay" runs the captured closure again, so
    it reads the persistent buffers as a graph does and keeps every size fixed at capture;
    it exists to test the buffers, the padding and the backends' graphed indices without a
    GPU (it cannot tell a host read inside the forward, which a real capture freezes)."""

    def warm_up(self, fn: Callable[[], torch.Tensor]) -> None:
        fn()

    def capture(self, fn: Callable[[], torch.Tensor]) -> Replay:
        fn()
        return fn


class DecodeGraphs:
    """The captured decode graphs of one runner, by bucket, over one ``StaticDecodeBuffers``."""

    def __init__(self, buffers: StaticDecodeBuffers, replays: dict[int, Replay]) -> None:
        self.buffers = buffers
        self.replays = replays
        self.sizes = sorted(replays)
        self.replayed_steps = 0  # steps served by a replay (the engine's stats report it)

    def serves(self, metadata: StepMetadata) -> bool:
        """Whether ``metadata`` is a step a graph replays: decodes only (one token per
        sequence, every row sampled in order, no prompt rows), at most the largest bucket,
        block tables within the buffers' width."""
        n = metadata.num_seqs
        return (0 < n <= self.sizes[-1] and metadata.num_decodes == n and metadata.num_tokens == n
                and len(metadata.logits_indices) == n and bool((metadata.logits_indices == np.arange(n)).all())
                and self.buffers.fits(metadata))

    def run(self, metadata: StepMetadata) -> torch.Tensor:
        """Replay the step (``serves``); the logits of its ``n`` rows, ``[n, vocab]``, a view
        of the graph's output that the next replay overwrites."""
        bucket = bucket_for(metadata.num_seqs, self.sizes)
        self.buffers.load(metadata, bucket)
        self.replayed_steps += 1
        return self.replays[bucket]()[:metadata.num_seqs]

    def verify(self, forwards: dict[int, Callable[[], torch.Tensor]]) -> None:
        """Replay the smallest and the largest bucket on inputs unlike the capture's and
        compare each with ``forwards[size]`` run eagerly on the same buffers
        (``RuntimeError`` when they differ)."""
        for size in sorted({self.sizes[0], self.sizes[-1]}):
            _verify_bucket(self, forwards[size], size)


#: How far a replay may differ from the eager forward it captured (the same kernels on the
#: same inputs: in practice not at all).
VERIFY_ATOL = 1e-3


def capture_decode_graphs(forward_for: Callable[[int], Callable[[], torch.Tensor]], buffers: StaticDecodeBuffers,
                          sizes: Sequence[int], capture: GraphCapture) -> DecodeGraphs:
    """Capture ``forward_for(bucket)`` (a closure over ``buffers``' views of that bucket) for
    every size, largest first, after warming each up; then ``verify`` the result.
    Raises ``RuntimeError`` when a replay does not reproduce its eager forward."""
    forwards = {size: forward_for(size) for size in sizes}
    for size in sorted(sizes, reverse=True):  # every kernel compiled, every launch buffer grown
        capture.warm_up(forwards[size])
    replays = {size: capture.capture(forwards[size]) for size in sorted(sizes, reverse=True)}
    graphs = DecodeGraphs(buffers, replays)
    graphs.verify(forwards)
    return graphs


def _verify_bucket(graphs: DecodeGraphs, forward: Callable[[], torch.Tensor], size: int) -> None:
    graphs.buffers.stage_probe(size)
    eager = forward().float().clone()
    replayed = graphs.replays[size]().float()
    if not torch.allclose(eager, replayed, atol=VERIFY_ATOL, rtol=0.0, equal_nan=True):
        worst = (eager - replayed).abs().nan_to_num(0.0).max().item()
        raise RuntimeError(f"the decode graph of batch {size} does not reproduce its eager forward on new inputs "
                           f"(largest difference {worst:.3g}): something in the forward was fixed at capture")
