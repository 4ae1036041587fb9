"""Assembles an ``LLMEngine`` around a loaded HF model: runner, KV buffers, sampler."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from kvpage.config import CacheConfig, SchedulerConfig
from kvpage.engine import LLMEngine
from kvpage.sampler import Sampler

from .attention_backends import select_backend
from .hf_runner import HFModelRunner


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


def _allocate_kv(runner: HFModelRunner, num_blocks: int, block_size: int) -> tuple[list, list]:
    device, dtype = runner.device, runner.kv_dtype
    keys, values = [], []
    for shape in runner.layer_shapes:
        dims = (num_blocks, block_size, shape.num_kv_heads, shape.head_dim)
        keys.append(torch.zeros(dims, dtype=dtype, device=device))
        values.append(torch.zeros(dims, dtype=dtype, device=device))
    return keys, values


def _num_kv_blocks(runner: HFModelRunner, options: EngineOptions, max_model_len: int) -> int:
    per_token = sum(2 * s.num_kv_heads * s.head_dim for s in runner.layer_shapes) * runner.kv_dtype.itemsize
    per_block = per_token * options.block_size
    if options.num_kv_blocks is not None:
        return options.num_kv_blocks
    if options.kv_cache_memory is not None:
        budget = options.kv_cache_memory
    else:
        budget = min(options.max_num_seqs * min(max_model_len, 1024) * per_token, 2 << 30)
    blocks = budget // per_block
    needed = -(-max_model_len // options.block_size)
    if blocks < max(1, needed):
        raise ValueError(
            f"KV budget of {budget} bytes holds {blocks} blocks of {per_block} bytes, but one request at "
            f"max_model_len={max_model_len} needs {needed} blocks"
        )
    return int(blocks)


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
    cache_config = CacheConfig(options.block_size, _num_kv_blocks(runner, options, max_model_len),
                               options.enable_prefix_caching)
    scheduler_config = SchedulerConfig(options.max_num_seqs, budget, max_model_len,
                                       options.enable_chunked_prefill, max_waiting=options.max_waiting)
    keys, values = _allocate_kv(runner, cache_config.num_blocks, cache_config.block_size)
    runner.bind(keys, values, select_backend(options.attention_backend, runner.device))
    vocab = int(model.get_output_embeddings().weight.shape[0]) if model.get_output_embeddings() is not None \
        else int(model.config.vocab_size)
    return LLMEngine(runner, Sampler(options.seed), tokenizer, cache_config, scheduler_config, vocab,
                     eos_token_ids(model, tokenizer))
