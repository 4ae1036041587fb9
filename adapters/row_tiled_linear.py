"""Linears whose every output row has bits that do not depend on the other rows of the call.

torch's CPU matmul (MKL, oneDNN) picks its kernel by the shape of the call, the row count
included: a row of ``F.linear`` over 70 rows can differ in its last bit from the same row
computed alone. In a serving engine the row count is the step's token count, which depends
on what else was scheduled, so a request's logits would depend on its neighbours and on
how its prompt was chunked. ``RowTiledLinear`` calls ``F.linear`` only on tiles of exactly
:data:`TILE_ROWS` rows (the last tile padded with zero rows): one shape, one kernel, and a
row's result depends on that row alone, wherever it sits in the tile
(``tests/test_batch_invariant.py`` holds this on the CPU the suite runs on). The price is
one call per tile and the padded rows' work.

``use_row_tiled_linears(model)`` swaps each ``nn.Linear`` *instance*, and each of
transformers' ``Conv1D`` (GPT-2's projections: ``x @ W + b``, the weight stored transposed),
for a ``RowTiledLinear`` sharing its parameters (no class is patched) and returns the undo
function, as :mod:`kvpage.adapters.onednn_linear` does for its linears.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from transformers.pytorch_utils import Conv1D

#: Rows per matmul call. A decode step of up to this many sequences is one call.
TILE_ROWS = 32


class RowTiledLinear(torch.nn.Module):
    """``nn.Linear``'s (or ``Conv1D``'s) forward, computed in tiles of :data:`TILE_ROWS`
    rows (inference only)."""

    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        self.weight, self.bias = layer.weight, layer.bias
        self.transposed = isinstance(layer, Conv1D)  # weight [in, out], applied by addmm
        self.in_features, self.out_features = (tuple(layer.weight.shape) if self.transposed
                                               else (layer.in_features, layer.out_features))

    def _project(self, rows: torch.Tensor) -> torch.Tensor:
        if self.transposed:
            return torch.addmm(self.bias, rows, self.weight)
        return F.linear(rows, self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        count = rows.shape[0]
        out = rows.new_empty(count, self.out_features)
        full = count - count % TILE_ROWS
        for start in range(0, full, TILE_ROWS):
            out[start:start + TILE_ROWS] = self._project(rows[start:start + TILE_ROWS])
        if full < count:
            tail = rows.new_zeros(TILE_ROWS, self.in_features)
            tail[:count - full] = rows[full:]
            out[full:] = self._project(tail)[:count - full]
        return out.view(*x.shape[:-1], self.out_features)


def use_row_tiled_linears(model: torch.nn.Module) -> Callable[[], None]:
    """Swap every ``nn.Linear`` and ``Conv1D`` of ``model`` for a ``RowTiledLinear``;
    returns the undo function."""
    swapped: list[tuple[torch.nn.Module, str, torch.nn.Module]] = []
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) in (torch.nn.Linear, Conv1D):
                setattr(parent, name, RowTiledLinear(child))
                swapped.append((parent, name, child))

    def undo() -> None:
        for parent, name, child in swapped:
            setattr(parent, name, child)
        swapped.clear()

    return undo
