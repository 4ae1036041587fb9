"""``kvpage::paged_attention``: write-KV + paged attention as one torch custom op.

``torch.compile`` cannot trace the attention backends (numba kernels, per-sequence loops),
so under compilation every attention layer calls this op instead: the rest of the model
compiles into one graph, with the op as its only opaque node per layer. Its inputs are the
layer's q/k/v ``[T, heads, D]`` and scalars; everything per step (KV buffers, slot mapping,
block tables, the backend) comes from the forward's context that the runner binds
(``forward_context``), read when the op runs, never while tracing.

Token rows past the context's ``num_real_tokens`` are bucket padding: they are neither
written nor attended, and their output is zero.
"""
from __future__ import annotations

from typing import Optional

import torch

from .forward_context import require_forward_context


@torch.library.custom_op("kvpage::paged_attention", mutates_args=())
def paged_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scaling: float,
                       sliding_window: int, softcap: float, sinks: Optional[torch.Tensor]) -> torch.Tensor:
    """``[T, H, D_v]`` attention output of layer ``layer`` (``sliding_window``/``softcap`` 0 = none)."""
    context = require_forward_context()
    n = context.num_real_tokens if context.num_real_tokens is not None else q.shape[0]
    out = context.attend(layer, q[:n], k[:n], v[:n], scaling, sliding_window or None, softcap or None, sinks)
    if n == q.shape[0]:
        return out.contiguous()
    padded = q.new_zeros(_out_shape(q, v))
    padded[:n] = out
    return padded


def _out_shape(q: torch.Tensor, v: torch.Tensor) -> tuple:
    """Queries' rows and heads, V's head size (MLA models: smaller than the query's)."""
    return (*q.shape[:-1], v.shape[-1])


@paged_attention_op.register_fake
def _(q, k, v, layer, scaling, sliding_window, softcap, sinks):
    return q.new_empty(_out_shape(q, v))
