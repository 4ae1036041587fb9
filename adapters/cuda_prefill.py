"""Which kernel serves the prefill rows of a CUDA step, and the step that splits its rows.

``prefill_kernel`` settings of the ``cuda`` backend (``CudaBackend(..., prefill_kernel=)``):

* ``"numba"``: every row goes to ``kvpage.cuda.paged_attention`` (its reference prefill
  kernel has float16/float32 only, so a bfloat16 prefill raises there);
* ``"sdpa"``: prefill rows go to the gather into torch's SDPA
  (:mod:`kvpage.attention.gather_sdpa`), decode rows to ``kvpage.cuda``; a call SDPA cannot
  serve (softcap, sinks, a quantized cache) is a ``ValueError`` that says why;
* ``"auto"`` (default): SDPA for bfloat16 prefills where it serves the call (the Numba
  prefill kernel cannot), else Numba. Which one is faster for float16 is unmeasured.

Quantized caches always stay on the Numba kernels: they dequantize in registers, and the
gather would need a dequantized copy.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from kvpage.attention.gather_sdpa import PrefillPlan, plan_prefill, run_prefill_plan, sdpa_unsupported
from kvpage.core.kv_formats import CacheFormat
from kvpage.core.sched.metadata import StepMetadata

PREFILL_KERNELS = ("auto", "numba", "sdpa")


def check_prefill_kernel(setting: str, cache_format: Optional[CacheFormat] = None) -> None:
    """Raise ``ValueError`` for an unknown setting, or ``"sdpa"`` over a quantized cache."""
    if setting not in PREFILL_KERNELS:
        raise ValueError(f"prefill_kernel must be one of {PREFILL_KERNELS}, got {setting!r}")
    reason = sdpa_unsupported(cache_format=cache_format)
    if setting == "sdpa" and reason:
        raise ValueError(f"prefill_kernel='sdpa' cannot serve this model: {reason}")


def choose_prefill_kernel(setting: str, dtype: torch.dtype, cache_format: Optional[CacheFormat] = None,
                          softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None) -> str:
    """``"numba"`` or ``"sdpa"``: the kernel for one layer call's prefill rows under ``setting``
    (see the module docstring), for q and caches of ``dtype``. Raises ``ValueError`` where
    ``"sdpa"`` is required and cannot serve the call."""
    check_prefill_kernel(setting)
    if setting == "numba":
        return "numba"
    reason = sdpa_unsupported(softcap, sinks, cache_format)
    if setting == "sdpa":
        if reason:
            raise ValueError(f"prefill_kernel='sdpa' cannot serve this call: {reason}")
        return "sdpa"
    return "sdpa" if reason is None and dtype == torch.bfloat16 else "numba"


@dataclass(slots=True)
class HostStep:
    """A step's host metadata for the SDPA prefill, and its plan once a layer has built it
    (every layer of the step's KV group reads the same blocks, so one plan serves them all)."""

    metadata: StepMetadata
    plan: Optional[PrefillPlan] = None

    def prefill_plan(self, block_size: int, device: torch.device) -> PrefillPlan:
        """The plan of the sequences after the decodes (built on the first call)."""
        if self.plan is None or self.plan.block_size != block_size:
            md = self.metadata
            self.plan = plan_prefill(md.query_start_loc, md.seq_lens, md.block_tables, block_size, md.num_decodes,
                                     device)
        return self.plan


def attend_decodes_then_sdpa(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                             device_meta: tuple[torch.Tensor, torch.Tensor, torch.Tensor], host: HostStep,
                             scaling: float, sliding_window: Optional[int]) -> torch.Tensor:
    """``[T, H, D]``: the leading decodes through ``kvpage.cuda.paged_attention``, the rest
    through the gather-SDPA plan. ``q`` contiguous; ``device_meta`` the step's
    (query_start_loc, seq_lens, block_tables) on the device, ``host`` the same step on the
    host. The caller has checked with :func:`choose_prefill_kernel` that SDPA serves the call
    (so there is no softcap and no sink)."""
    md = host.metadata
    num_decodes = md.num_decodes
    out = q.new_empty(q.shape)
    if num_decodes:
        from kvpage.cuda import paged_attention

        qsl, seq_lens, tables = device_meta
        out[:num_decodes] = paged_attention(q[:num_decodes], key_cache, value_cache, qsl[:num_decodes + 1],
                                            seq_lens[:num_decodes], tables[:num_decodes], scaling, sliding_window,
                                            num_decodes=num_decodes, max_prefill_query_len=0,
                                            max_seq_len=md.max_decode_seq_len)
    plan = host.prefill_plan(int(key_cache.shape[1]), q.device)
    run_prefill_plan(plan, q, key_cache, value_cache, scaling, sliding_window, out=out[plan.first_row:])
    return out
