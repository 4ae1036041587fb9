"""Assembles an ``LLMEngine`` around a loaded HF model: runner, KV buffers, sampler."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from kvpage.config import CacheConfig, SchedulerConfig
from kvpage.engine import LLMEngine
from kvpage.kv_storage import KVCacheSpec, PagedKVCache, determine_num_blocks
from kvpage.sampler import Sampler

from .attention_backends import select_backend
from .hf_runner import HFModelRunner, UnsupportedModelError


@dataclass(frozen=True, slots=True)
class EngineOptions:
    """User-facing engine knobs (vLLM names). Token counts in tokens, memory in bytes."""

    block_size: int = 16
    num_kv_blocks: Optional[int] = None
    kv_cache_memory: Optional[int] = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    max_model_len: Optional[int] = None
    seed: int = 0
    attention_backend: str = "auto"
    max_waiting: Optional[int] = None


def model_max_len(model: torch.nn.Module) -> int:
    config = model.config
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 2048


def eos_token_ids(model: torch.nn.Module, tokenizer: Any) -> list[int]:
    """EOS ids from the generation config (may be several), else the tokenizer."""
    found: list[int] = []
    gen = getattr(model, "generation_config", None)
    value = getattr(gen, "eos_token_id", None) if gen is not None else None
    if value is None:
        value = getattr(model.config, "eos_token_id", None)
    if value is None and tokenizer is not None:
        value = tokenizer.eos_token_id
    for item in value if isinstance(value, (list, tuple)) else [value]:
        if item is not None and int(item) not in found:
            found.append(int(item))
    return found


def kv_cache_spec(runner: HFModelRunner, block_size: int) -> KVCacheSpec:
    """One KV layout for all layers; models whose layers differ are refused."""
    shapes = set(runner.layer_shapes)
    if len(shapes) != 1:
        raise UnsupportedModelError(f"layers have different KV shapes {sorted(shapes)}; kvpage needs one per model")
    (shape,) = shapes
    dtype = str(runner.kv_dtype).removeprefix("torch.")
    return KVCacheSpec(len(runner.layer_shapes), shape.num_kv_heads, shape.head_dim, block_size, dtype)


def profile_gpu_memory(runner: HFModelRunner, num_tokens: int) -> dict:
    """One forward of ``num_tokens`` tokens (attention stubbed) to measure peak activations, in bytes."""
    device = runner.device
    torch.cuda.synchronize(device)
    used = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    runner.probe_forward(num_tokens)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - used
    return {"total_device_bytes": torch.cuda.get_device_properties(device).total_memory,
            "used_device_bytes": used, "peak_activation_bytes": peak}


def size_kv_cache(runner: HFModelRunner, spec: KVCacheSpec, options: EngineOptions, max_model_len: int,
                  step_tokens: int) -> int:
    """Blocks for the KV cache: explicit count, byte budget, GPU profile, or the CPU default."""
    measured = {}
    on_gpu = runner.device.type == "cuda"
    if on_gpu and options.num_kv_blocks is None and options.kv_cache_memory is None:
        measured = profile_gpu_memory(runner, step_tokens)
    return determine_num_blocks(spec, num_kv_blocks=options.num_kv_blocks, kv_cache_memory=options.kv_cache_memory,
                                gpu_memory_utilization=options.gpu_memory_utilization,
                                device="cuda" if on_gpu else "cpu", max_num_seqs=options.max_num_seqs,
                                max_model_len=max_model_len, **measured)


def build_hf_engine(model: torch.nn.Module, tokenizer: Any, options: EngineOptions) -> LLMEngine:
    """Switch ``model`` to kvpage attention and return an engine bound to it."""
    runner = HFModelRunner(model)
    limit = model_max_len(model)
    max_model_len = options.max_model_len or limit
    if max_model_len > limit:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's {limit} positions")
    budget = options.max_num_batched_tokens
    if not options.enable_chunked_prefill:
        budget = max(budget, max_model_len)  # a prompt must fit one step whole
    spec = kv_cache_spec(runner, options.block_size)
    cache_config = CacheConfig(options.block_size, size_kv_cache(runner, spec, options, max_model_len, budget),
                               options.enable_prefix_caching)
    scheduler_config = SchedulerConfig(options.max_num_seqs, budget, max_model_len,
                                       options.enable_chunked_prefill, max_waiting=options.max_waiting)
    storage = "cupy" if runner.device.type == "cuda" else "torch"
    kv_cache = PagedKVCache(spec, cache_config.num_blocks, backend=storage)
    runner.bind(kv_cache, select_backend(options.attention_backend, runner.device))
    vocab = int(model.get_output_embeddings().weight.shape[0]) if model.get_output_embeddings() is not None \
        else int(model.config.vocab_size)
    return LLMEngine(runner, Sampler(options.seed), tokenizer, cache_config, scheduler_config, vocab,
                     eos_token_ids(model, tokenizer))
