"""How many KV blocks to allocate: the sizing rules and their precedence.

``determine_num_blocks`` is pure: every measurement (device memory, activation peak, free
RAM) comes in as an argument; ``free_ram_bytes`` reads the one the CPU default needs.
Torch-free.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from kvpage.core.kv.kv_groups import KVCacheGroups
from kvpage.storage.spec import KVCacheSpec

#: CPU default budget: room for ``max_num_seqs`` sequences of this many tokens (or
#: ``max_model_len`` if shorter) ...
CPU_EXPECTED_SEQ_TOKENS = 1024
#: ... capped at this fraction of free RAM (model weights and activations live there too) ...
CPU_MAX_FREE_RAM_FRACTION = 0.25
#: ... and at this absolute size (bytes): a CPU engine is bandwidth-bound long before a
#: larger cache pays off.
CPU_MAX_KV_BYTES = 4 << 30


def _check_count(num_kv_blocks: object) -> int:
    if isinstance(num_kv_blocks, bool) or not isinstance(num_kv_blocks, int) or num_kv_blocks <= 0:
        raise ValueError(f"num_kv_blocks must be a positive integer, got {num_kv_blocks!r}")
    return num_kv_blocks


def free_ram_bytes() -> int:
    """Available RAM (bytes): ``MemAvailable`` of /proc/meminfo, else sysconf free pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


#: The names of the sizing rules, in precedence order (see ``determine_num_blocks``).
SIZING_RULES = ("explicit count", "byte budget", "GPU profile", "CPU default")


def kv_sizing_rule(num_kv_blocks: Optional[int] = None, kv_cache_memory: Optional[int] = None,
                   device: str = "cpu") -> str:
    """Which of ``SIZING_RULES`` ``determine_num_blocks`` applies to these arguments.

    The one statement of the precedence: an explicit block count, then a byte budget, then
    the GPU profile on a CUDA device, else the CPU default.
    """
    if num_kv_blocks is not None:
        return SIZING_RULES[0]
    if kv_cache_memory is not None:
        return SIZING_RULES[1]
    return SIZING_RULES[2] if device.startswith(("cuda", "gpu")) else SIZING_RULES[3]


def determine_num_blocks(spec: KVCacheSpec, *, num_kv_blocks: Optional[int] = None,
                         kv_cache_memory: Optional[int] = None, gpu_memory_utilization: Optional[float] = None,
                         device: str = "cpu", max_num_seqs: int = 1, max_model_len: int = 2048,
                         total_device_bytes: Optional[int] = None, used_device_bytes: Optional[int] = None,
                         peak_activation_bytes: Optional[int] = None, free_ram_bytes: Optional[int] = None,
                         groups: Optional[KVCacheGroups] = None, chunk_tokens: int = 1) -> int:
    """Number of KV blocks to allocate. Pure: every measurement comes in as an argument.

    Precedence:
      1. ``num_kv_blocks`` given: that many.
      2. ``kv_cache_memory`` (bytes) given: as many blocks as fit.
      3. GPU (``device`` "cuda"/"gpu"): ``gpu_memory_utilization * total_device_bytes -
         (used_device_bytes + peak_activation_bytes)``, where ``used_device_bytes`` is the
         non-KV memory in use (weights, workspace) and ``peak_activation_bytes`` the
         activation peak the engine measured with one profile forward.
      4. CPU (``gpu_memory_utilization`` does not apply): enough for ``max_num_seqs``
         sequences of ``min(max_model_len, CPU_EXPECTED_SEQ_TOKENS)`` tokens, capped at
         ``CPU_MAX_FREE_RAM_FRACTION`` of free RAM (read from /proc/meminfo when not
         given) and at ``CPU_MAX_KV_BYTES``.
    With hybrid ``groups`` a block is ``groups.group_size`` layers' worth
    (``KVCacheSpec.bytes_per_block_of``) and one request holds
    ``groups.blocks_per_request`` blocks, its sliding groups writing ``chunk_tokens`` per
    step at most (the step's token budget).
    Raises ValueError, with the numbers, when the result is under one block or cannot hold
    one request of ``max_model_len`` tokens.
    """
    if not spec.layers:  # no attention: blocks cost no memory and only count tokens
        if num_kv_blocks is not None:
            return _check_count(num_kv_blocks)
        return max_num_seqs * spec.blocks_for_tokens(max_model_len)
    sizes = _BlockSizes.of(spec, groups or KVCacheGroups.single(spec.num_layers), max_model_len, chunk_tokens)
    rule = kv_sizing_rule(num_kv_blocks, kv_cache_memory, device)
    if rule == "explicit count":
        return _check(_check_count(num_kv_blocks), sizes, max_model_len, f"num_kv_blocks={num_kv_blocks}")
    if rule == "byte budget":
        budget, source = int(kv_cache_memory), f"kv_cache_memory={kv_cache_memory} bytes"
    elif rule == "GPU profile":
        budget, source = _gpu_budget(gpu_memory_utilization, total_device_bytes, used_device_bytes,
                                     peak_activation_bytes)
    else:
        budget, source = _cpu_budget(sizes, max_num_seqs, max_model_len, free_ram_bytes)
    num_blocks = budget // sizes.bytes_per_block if budget > 0 else 0
    if num_blocks < 1:
        raise ValueError(f"KV budget too small for one block: {source} -> {budget} bytes < "
                         f"{sizes.bytes_per_block} bytes per block")
    return _check(num_blocks, sizes, max_model_len, source)


@dataclass(frozen=True, slots=True)
class _BlockSizes:
    bytes_per_block: int
    block_size: int
    per_request: int  # blocks one request of max_model_len tokens holds
    per_default_seq: int  # blocks one request of the CPU default's length holds

    @classmethod
    def of(cls, spec: KVCacheSpec, groups: KVCacheGroups, max_model_len: int, chunk_tokens: int) -> "_BlockSizes":
        """Sliding groups of a request write ``chunk_tokens`` per step at most."""
        per_request = groups.blocks_per_request(max_model_len, spec.block_size, min(chunk_tokens, max_model_len))
        per_default_seq = groups.blocks_per_request(min(max_model_len, CPU_EXPECTED_SEQ_TOKENS), spec.block_size)
        return cls(spec.bytes_per_block_of(groups), spec.block_size, per_request, per_default_seq)


def _check(num_blocks: int, sizes: _BlockSizes, max_model_len: int, source: str) -> int:
    need = sizes.per_request
    if num_blocks < need:
        raise ValueError(f"KV cache of {num_blocks} blocks ({source}) cannot hold one request of "
                         f"max_model_len={max_model_len} tokens: needs {need} blocks of "
                         f"{sizes.block_size} tokens ({need * sizes.bytes_per_block} bytes)")
    return num_blocks


def _gpu_budget(utilization, total, used, peak) -> tuple[int, str]:
    if utilization is None or not 0.0 < utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization!r}")
    if total is None or used is None or peak is None:
        raise ValueError("GPU sizing needs total_device_bytes, used_device_bytes and peak_activation_bytes")
    budget = int(utilization * total) - (int(used) + int(peak))
    return budget, (f"gpu_memory_utilization={utilization} * total {total} - (used {used} + "
                    f"peak activation {peak}) bytes")


def _cpu_budget(sizes: _BlockSizes, max_num_seqs: int, max_model_len: int, free_ram) -> tuple[int, str]:
    free = free_ram_bytes_fn() if free_ram is None else int(free_ram)
    tokens = min(max_model_len, CPU_EXPECTED_SEQ_TOKENS)
    wanted = max_num_seqs * sizes.per_default_seq * sizes.bytes_per_block
    cap = min(int(free * CPU_MAX_FREE_RAM_FRACTION), CPU_MAX_KV_BYTES)
    return min(wanted, cap), (f"CPU default min({max_num_seqs} seqs x {tokens} tokens = {wanted}, "
                              f"{CPU_MAX_FREE_RAM_FRACTION} x free RAM {free}, {CPU_MAX_KV_BYTES}) bytes")


free_ram_bytes_fn = free_ram_bytes  # the parameter of determine_num_blocks shadows the name
