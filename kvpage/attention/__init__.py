"""Paged attention operations: one contract, several backends.

Every backend implements the same two operations over paged KV buffers shaped
``[num_blocks, block_size, num_kv_heads, head_dim]`` (one buffer for K, one for V):

* ``write_kv(key_cache, value_cache, k, v, slot_mapping)``: scatter the step's new
  K/V rows (``[T, num_kv_heads, head_dim]``) into flat slots
  (``slot = block_id * block_size + offset``).
* ``paged_attention(q, key_cache, value_cache, query_start_loc, seq_lens, block_tables,
  scaling, sliding_window=None, softcap=None, sinks=None)``: ``q`` is ``[T, num_heads,
  head_dim]`` (a ragged batch flattened by ``query_start_loc``); sequence ``i``'s queries
  are its last ``q_len`` positions of a context of ``seq_lens[i]`` tokens and attend
  causally to the whole context. Returns ``[T, num_heads, head_dim]`` in ``q``'s dtype.

``reference`` is the plain implementation all others are tested against. On CPU,
``cpu.CPUKernels`` binds one attention site's kernels once (``cpu.CPUAttention`` holds a
model's), and also offers ``write_and_attend``: both operations in one call (one native
call per layer for decode-only steps).

A quantized KV cache (``kv_cache_dtype`` fp8, int8, int4) is uint8 ``[num_blocks,
block_bytes]`` buffers, whose :class:`~kvpage.core.kv_formats.CacheFormat` every operation
takes as ``cache_format=``: stores quantize each token's rows, and attention reads K/V only
back from the cache (the current step's rows included), dequantizing each context's rows.
"""
from kvpage.attention.cpu import paged_attention_cpu, write_and_attend_cpu, write_kv_cpu
from kvpage.attention.cpu_metadata import CPUAttentionMetadata, prepare_cpu_attention_metadata
from kvpage.attention.reference import paged_attention_reference, write_kv_reference

# ``cpu`` imports numpy only; its native/numba/torch backends load when a layout is bound.
__all__ = ["paged_attention_reference", "write_kv_reference", "paged_attention_cpu", "write_kv_cpu",
           "write_and_attend_cpu", "prepare_cpu_attention_metadata", "CPUAttentionMetadata"]
