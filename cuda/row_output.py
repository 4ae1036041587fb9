"""The epilogue both attention kernels share: one element of a finished row, written out.

A row (one query token and head) ends with its running max ``m``, running sum ``l`` and
unnormalised accumulator; with split-K (``write_partials != 0``) those go to the
``part_*`` buffers for ``attention_kernels.merge_kernel``, otherwise the normalised value
goes to ``out`` (a sink adds ``exp(sink)`` to the denominator only; a row with no keys
and no sink gets 0). A device function, compiled into each kernel that calls it.
"""
from __future__ import annotations

import math

from numba import cuda, float32

NEG_INF = -math.inf


@cuda.jit(device=True, inline=True)
def write_row_element(tok, head, split, d, m, l, acc, write_partials, sinks, has_sinks, out, part_max, part_sum,
                      part_acc):
    """Element ``d`` of row ``(tok, head)``: its partials for split ``split``, or ``out[tok, head, d]``."""
    if write_partials != 0:
        part_acc[tok, head, split, d] = acc
        if d == 0:
            part_max[tok, head, split] = m
            part_sum[tok, head, split] = l
    else:
        scale = float32(1.0)
        denom = l
        if has_sinks != 0:
            sink = float32(sinks[head])
            mm = max(m, sink)
            scale = math.exp(m - mm) if m != NEG_INF else float32(0.0)
            denom = l * scale + math.exp(sink - mm)
        res = float32(0.0)
        if denom > 0:
            res = acc * scale / denom
        out[tok, head, d] = res
