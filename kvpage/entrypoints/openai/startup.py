"""What a server does once its engine is loaded: a warm-up forward, and the start-up report.

Shared by ``kvpage serve`` and each Ray Serve replica, so both warm up and report alike.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from kvpage.core.config import EngineConfig
from kvpage.core.sched.step_budget import AUTO_DECODE_MULTIPLE, AUTO_FLOOR_MS
from kvpage.storage.sizing import kv_sizing_rule

if TYPE_CHECKING:
    from kvpage.adapters.hf_runner import HFModelRunner
    from kvpage.entrypoints.llm import LLM

log = logging.getLogger("kvpage")


def step_target_summary(max_step_ms) -> str:
    """How a step's prompt tokens are bounded, in words (``SchedulerConfig.max_step_ms``)."""
    if max_step_ms is None:
        return "off (the static token budget alone)"
    if max_step_ms == "auto":
        return f"auto ({AUTO_DECODE_MULTIPLE:g}x the decodes' cost, at least {AUTO_FLOOR_MS:g} ms)"
    return f"{max_step_ms:g} ms"


def engine_summary(llm: "LLM", config: EngineConfig) -> list[str]:
    """The start-up report: model, dtype, device, threads, the KV pool and its sizing rule,
    and the scheduler's limits as the engine applies them."""
    import torch

    runner, stats = llm.runner, llm.stats()
    sched = llm.engine.scheduler.config  # after the engine's own changes (a recurrent model's, say)
    device = llm.device
    dtype = str(next(llm.model.parameters()).dtype).removeprefix("torch.")
    backend = getattr(runner.backend, "name", type(runner.backend).__name__)
    kv = getattr(runner, "kv_cache", None)
    size = ""
    if kv is not None:
        size = f", {kv.nbytes / 2**20:.1f} MiB {kv.spec.kv_format.name}, {kv.spec.bytes_per_token} bytes per token"
    rule = kv_sizing_rule(config.num_kv_blocks, config.kv_cache_memory, device.type)
    limit = llm.max_model_len
    kernels = ""
    if device.type == "cpu" and kv is not None and kv.spec.layers:
        from kvpage.attention.cpu import cpu_kernels_summary

        kernels = f" ({cpu_kernels_summary(kv.spec.dtype, [layer.k_head_dim for layer in kv.spec.layers])})"
    return [
        f"model {llm.model_path or type(llm.model).__name__}: dtype {dtype}, device {device}, "
        f"threads {torch.get_num_threads()}, attention backend {backend}{kernels}, max_model_len {limit}",
        f"KV cache: {stats['num_blocks']} blocks of {config.block_size} tokens "
        f"({stats['num_blocks'] * config.block_size} tokens{size}); sized by the {rule} rule",
        f"scheduler: up to {sched.max_num_seqs} sequences and {sched.max_num_batched_tokens} tokens a step, "
        f"chunked prefill {'on' if sched.enable_chunked_prefill else 'off'}, "
        f"step-time target {step_target_summary(sched.max_step_ms)}",
        mode_summary(runner),
    ]


def mode_summary(runner: "HFModelRunner") -> str:
    """How the model runs: compiled or eager, which linears, CUDA graphs, and whether greedy
    output is HF ``generate``'s token for token (the exact mode)."""
    compiled, graphs = runner.compiled, runner.decode_graphs
    if compiled is None and not runner.onednn_linears and graphs is None:
        return "mode: exact (eager, torch's linears): greedy output equals HF generate token for token"
    parts = [f"compiled forward ({compiled.compile_seconds:.1f} s to compile or load from the cache)"
             if compiled is not None else "eager"]
    if runner.onednn_linears:
        dtype, why = runner.linear_compute
        parts.append(f"oneDNN linears computing in {str(dtype).removeprefix('torch.')} ({why})")
    if graphs is not None:
        parts.append(f"decode steps of 1-{graphs.sizes[-1]} sequences replayed from {len(graphs.sizes)} CUDA graphs")
    return f"mode: fast ({', '.join(parts)}); --exact for greedy output identical to HF generate"


def warm_up(llm: "LLM") -> float:
    """One prefill and one decode through the whole engine; returns the seconds it took.

    The warm-up request counts in the engine's token counters like any other.
    """
    log.info("warming up: one prefill and one decode (first use compiles the kernels) ...")
    start = time.perf_counter()
    llm.warm_up()
    elapsed = time.perf_counter() - start
    log.info("warm-up done in %.1f s", elapsed)
    return elapsed
