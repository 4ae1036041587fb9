"""DeepSeek sparse attention (DSA) over paged KV: the indexer's keys paged beside the KV.

DSA models (DeepSeek-V3.2, GLM-MoE-DSA, Dots3, HY-V4, AXK2) give each attention layer an
*indexer*: a small module that scores every earlier token for each query (per-head ReLU
dot products against one key per token, weighted by the query's head weights) and keeps
the ``index_topk`` best; attention then reads only those keys. In transformers the
indexer keeps its keys in the model's ``Cache`` (``update_indexer``). kvpage pages them
instead: each indexer is one more attention *site* of its layer (K rows of one head of
``index_head_dim``, V rows of size 0), written by slot like any KV, and the selected
positions reach kvpage attention as the ``indices`` transformers hands it.

``install_indexer_ports(model)`` swaps an ``IndexerPort`` in for every indexer module, on
the loaded instance (no class is patched); the port runs the original module's own
forward (its projections, norm and rotary variant differ by family) twice per step, each
time with a stand-in cache: the first pass's ``update_indexer`` stores the step's new keys,
the second's returns each sequence's paged keys, against which its picks are made.

**The same top-k as HF.** ReLU scores tie exactly (at 0) whenever all index heads score a
key negative, and ``torch.topk`` resolves ties differently for rows of different lengths.
So each score row is as long as HF's: HF scores a prompt token against the whole prompt
(the later tokens masked) and a generated token against its context. The port therefore
runs the indexer once per sequence for its prompt rows (rows of the prompt's length,
whatever the chunk) and once per generated row (a decode is one; a sequence recomputed
after preemption has one per generated token). At such ties HF's picks for a prompt's
early tokens also depend on how long the prompt is, so a prefix cached from one prompt
carries that prompt's picks; checkpoints (64 index heads) do not tie. This path is eager,
on CPU, and loops over sequences: correctness first, for the families' small
configurations.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch
from torch import nn

from kvpage.storage.spec import LayerKVSpec

from .forward_context import ProbeContext, require_forward_context

#: A layer's indexer: a child named ``indexer`` of its attention module.
_INDEXER_NAME = "indexer"


def _indexers(model: nn.Module) -> list[tuple[nn.Module, nn.Module]]:
    """``(parent, indexer)`` for every DSA indexer module of ``model``."""
    found = []
    for parent in model.modules():
        child = getattr(parent, _INDEXER_NAME, None)
        if isinstance(child, nn.Module) and not isinstance(child, IndexerPort) and hasattr(child, "index_topk") \
                and hasattr(child, "layer_idx"):
            found.append((parent, child))
    return found


def has_indexers(model: nn.Module) -> bool:
    """Whether ``model`` has DSA indexers that kvpage pages (ported or not yet)."""
    return bool(_indexers(model)) or any(isinstance(m, IndexerPort) for m in model.modules())


def install_indexer_ports(model: nn.Module) -> Callable[[], None]:
    """Swap an ``IndexerPort`` in for each indexer of ``model``; returns the undo."""
    swapped = []
    for parent, indexer in _indexers(model):
        setattr(parent, _INDEXER_NAME, IndexerPort(indexer))
        swapped.append((parent, indexer))

    def undo() -> None:
        for parent, indexer in swapped:
            setattr(parent, _INDEXER_NAME, indexer)

    return undo


class _StoreIndexerKeys:
    """The ``cache`` argument of the first pass: ``update_indexer(k [1, R, D])`` stores the
    rows' keys at their slots and hands them back (scores among themselves, discarded)."""

    def __init__(self, key_cache: torch.Tensor, slots: torch.Tensor) -> None:
        self.key_cache, self.slots = key_cache, slots

    def update_indexer(self, k: torch.Tensor, layer_idx: int) -> torch.Tensor:
        flat = self.key_cache.view(-1, self.key_cache.shape[-1])  # one head: [slots, D]
        flat.index_copy_(0, self.slots, k[0].to(flat.dtype))
        return k


class _PagedIndexerKeys:
    """The ``cache`` argument of the second pass: ``update_indexer`` returns the sequence's
    stored keys ``[1, L, D]`` for positions ``0 .. L-1`` (zeros past ``known``, the newest
    stored position + 1, which the row mask hides)."""

    def __init__(self, key_cache: torch.Tensor, block_ids: torch.Tensor, known: int, row_length: int) -> None:
        self.key_cache, self.block_ids = key_cache, block_ids
        self.known, self.row_length = known, row_length

    def update_indexer(self, k: torch.Tensor, layer_idx: int) -> torch.Tensor:
        block_size = self.key_cache.shape[1]
        blocks = self.block_ids[: -(-self.known // block_size)]
        stored = torch.index_select(self.key_cache, 0, blocks).view(-1, self.key_cache.shape[-1])[: self.known]
        out = k.new_zeros((1, self.row_length, k.shape[-1]))
        width = min(self.known, self.row_length)
        out[0, :width] = stored[:width].to(k.dtype)
        return out


class IndexerPort(nn.Module):
    """Takes an indexer's place; returns ``[1, T, index_topk]`` int64 selected key positions
    per query row of the step (-1: none), which the attention module passes on to kvpage
    attention as ``indices``."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.layer_idx = inner.layer_idx
        self.index_topk = int(inner.index_topk)

    def forward(self, hidden_states: torch.Tensor, q_resid: torch.Tensor, position_embeddings, *args, **kwargs):
        context = require_forward_context()
        if isinstance(context, ProbeContext):
            return self._probe(context, hidden_states, q_resid, position_embeddings)
        # Its site's key buffer (one head; the value buffer is empty); the port writes its own keys.
        site = context.next_site(self.layer_idx)
        if len(context.prepared) > 1:
            raise RuntimeError("a DSA indexer needs the step's metadata and one KV group")
        return self._select(site.key_cache, context.metadata, hidden_states, q_resid, position_embeddings)

    def _run(self, hidden_states, q_resid, position_embeddings, rows: slice, mask: torch.Tensor, cache) -> torch.Tensor:
        cos, sin = position_embeddings
        return self.inner(hidden_states[:, rows], q_resid[:, rows], (cos[:, rows], sin[:, rows]), mask, None,
                          cache=cache)

    def _probe(self, probe, hidden_states, q_resid, position_embeddings) -> torch.Tensor:
        """Record this site's layout (the key row the indexer stores) and select nothing."""
        seen: list = []

        class _Record:
            def update_indexer(self, k, layer_idx):
                seen.append(k)
                return k

        tokens = hidden_states.shape[1]
        causal = torch.ones((1, tokens, tokens), dtype=torch.bool, device=hidden_states.device).tril()
        self._run(hidden_states, q_resid, position_embeddings, slice(0, tokens), causal, _Record())
        if not seen:
            raise RuntimeError(f"{type(self.inner).__name__} stored no keys: kvpage cannot page its indexer")
        probe.record_site(self.layer_idx, LayerKVSpec(1, int(seen[0].shape[-1]), 1, 0), seen[0].dtype)
        return torch.full((1, tokens, self.index_topk), -1, dtype=torch.long, device=hidden_states.device)

    def _select(self, key_cache, metadata, hidden_states, q_resid, position_embeddings) -> torch.Tensor:
        """Two passes over the step's runs of rows: every run stores its keys, then every run
        scores against its sequence's stored keys. A sequence may read keys that another one
        computes in the same step (a prefix block shared as it is filled), so all keys must be
        stored before any run scores."""
        device = hidden_states.device
        num_rows = hidden_states.shape[1]
        positions = metadata.positions
        slots = torch.as_tensor(metadata.slot_mapping, dtype=torch.long, device=device)
        tables = torch.as_tensor(metadata.block_tables, dtype=torch.long, device=device)
        starts = metadata.query_start_loc.tolist()
        runs = []  # (sequence, first row, end row, score row length)
        for seq, prompt_len in enumerate(metadata.prompt_lens.tolist()):
            start, end = starts[seq], starts[seq + 1]
            # Prompt rows share one run (rows of the prompt's length); each generated row runs alone.
            first_generated = start + int(np.searchsorted(positions[start:end], prompt_len))
            if first_generated > start:
                runs.append((seq, start, first_generated, prompt_len))
            runs += [(seq, row, row + 1, int(positions[row]) + 1) for row in range(first_generated, end)]
        for _, lo, hi, _ in runs:
            causal = torch.ones((1, hi - lo, hi - lo), dtype=torch.bool, device=device).tril()
            self._run(hidden_states, q_resid, position_embeddings, slice(lo, hi), causal,
                      _StoreIndexerKeys(key_cache, slots[lo:hi]))
        selection = torch.full((num_rows, self.index_topk), -1, dtype=torch.long, device=device)
        for seq, lo, hi, row_length in runs:
            cache = _PagedIndexerKeys(key_cache, tables[seq], int(positions[hi - 1]) + 1, row_length)
            row_pos = torch.as_tensor(positions[lo:hi], device=device).view(-1, 1)
            mask = (torch.arange(row_length, device=device).view(1, -1) <= row_pos)[None]
            picked = self._run(hidden_states, q_resid, position_embeddings, slice(lo, hi), mask, cache)[0].long()
            # A row with fewer visible keys than the top-k also picks masked ones: drop them.
            selection[lo:hi, : picked.shape[1]] = torch.where(picked <= row_pos, picked, -1)
        return selection[None]
