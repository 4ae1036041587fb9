"""Loads a Hugging Face model and assembles an ``LLMEngine`` around it: runner, KV buffers, sampler.

Every setting comes from one ``EngineConfig``; the KV storage's block size and the
scheduler's are both taken from ``config.block_size``.
"""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, NamedTuple, Optional

import torch

from kvpage.core.config import EngineConfig
from kvpage.core.kv.kv_groups import KVCacheGroups
from kvpage.core.sched.scheduler import Scheduler
from kvpage.engine.llm_engine import LLMEngine
from kvpage.storage.kv_storage import KVCacheSpec, PagedKVCache, determine_num_blocks
from kvpage.platform.malloc_tuning import keep_freed_memory
from kvpage.engine.sampler import Sampler
from kvpage.platform.thread_governor import governor_for, governor_wanted
from kvpage.platform.threads import configure_threads, set_compute_threads
from kvpage.storage.tiers import attach_kv_tiers

from kvpage.adapters.attention_backends import select_backend
from kvpage.adapters.hf_runner import HFModelRunner, UnsupportedModelError

log = logging.getLogger("kvpage")

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
           "half": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"device: {exc}") from exc
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: 'cuda' was asked for but no CUDA device is available")
    return resolved


def cpu_has_fast_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """True on CPUs with bf16 dot-product instructions (AVX512-BF16 or AMX-BF16)."""
    try:
        flags = open(cpuinfo).read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(dtype: str, device: torch.device, model_dtype: Optional[torch.dtype] = None) -> torch.dtype:
    """The weights' and KV's dtype. ``"auto"``: fp16 on GPU (the Numba kernels take fp16/fp32);
    on CPU bf16 where the CPU has bf16 instructions and the model is bf16 or fp32 (it halves
    weight and KV traffic and doubles matmul speed), else fp32."""
    if dtype == "auto":
        if device.type != "cpu":
            chosen, why = torch.float16, "GPU"
        elif model_dtype in (torch.bfloat16, torch.float32, None) and cpu_has_fast_bf16():
            chosen, why = torch.bfloat16, "CPU with bf16 instructions"
        else:
            chosen, why = torch.float32, "CPU without bf16 instructions" if model_dtype != torch.float16 else \
                "a float16 model on CPU"
        log.info("dtype auto -> %s (%s)", str(chosen).removeprefix("torch."), why)
        return chosen
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


def _declared_dtype(path: str) -> Optional[torch.dtype]:
    """The dtype a model folder's config.json declares, if any."""
    import json

    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    name = config.get("dtype") or config.get("torch_dtype")
    return _DTYPES.get(name) if isinstance(name, str) else None


def load_model(model: Any, tokenizer: Any, config: EngineConfig) -> tuple[Any, Any, Optional[str]]:
    """Return (model, tokenizer, local path or None) for a path, an alias or a loaded model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

    from kvpage.platform.model_registry import resolve_model_path

    if isinstance(model, PreTrainedModel):
        if isinstance(tokenizer, (str, Path)):
            tokenizer = AutoTokenizer.from_pretrained(str(tokenizer))
        return model.eval(), tokenizer, None
    if not isinstance(model, (str, Path)):
        raise ValueError(f"model must be a path, an alias or a PreTrainedModel, got {type(model).__name__}")
    path = resolve_model_path(str(model))
    device = resolve_device(config.device)
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=resolve_dtype(config.dtype, device, _declared_dtype(path)))
    loaded = loaded.to(device).eval()
    if tokenizer is None or isinstance(tokenizer, (str, Path)):
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer or path))
    return loaded, tokenizer, path


def model_max_len(model: torch.nn.Module) -> int:
    config = model.config.get_text_config()
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


def kv_cache_spec(runner: HFModelRunner, config: EngineConfig) -> KVCacheSpec:
    """The model's per-layer KV spec, as the runner's probe forward found it."""
    dtype = str(runner.kv_dtype).removeprefix("torch.")
    return KVCacheSpec(tuple(runner.layer_specs), config.block_size, dtype)


def check_backend_fits(spec: KVCacheSpec, backend_name: str) -> None:
    """The CUDA kernels read K and V of one shape; refuse other layouts there, with the layer."""
    if backend_name != "cuda":
        return
    for i, layer in enumerate(spec.layers):
        if layer.attention_chunk:
            raise UnsupportedModelError(f"layer {i} attends in chunks of {layer.attention_chunk} positions; the CUDA "
                                        "kernels do not implement chunked attention (use device='cpu')")
        if (layer.k_heads, layer.k_head_dim) != (layer.v_heads, layer.v_head_dim):
            raise UnsupportedModelError(
                f"layer {i} has K [{layer.k_heads}, {layer.k_head_dim}] and V [{layer.v_heads}, {layer.v_head_dim}] "
                "per token; the CUDA kernels need one shape for both (use device='cpu')")


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


def kv_groups(spec: KVCacheSpec, config: EngineConfig) -> KVCacheGroups:
    """The KV groups the engine runs with (hybrid unless disabled or the model is not), logged."""
    groups = spec.kv_groups(hybrid=config.hybrid_kv_cache)
    if groups.is_hybrid:
        kinds = ", ".join(f"{len(g.layers)} layers {'window ' + str(g.sliding_window) if g.is_sliding else 'full'}"
                          for g in groups.groups)
        log.info("hybrid KV cache: %d groups of %d layers (%s)", groups.num_groups, groups.group_size, kinds)
    elif any(layer.sliding_window for layer in spec.layers):
        reason = groups.reason
        if config.uses_kv_tiers and not config.disable_hybrid_kv_cache_manager:
            reason = "the KV tiers need a single KV group"
        log.info("sliding-window layers keep the whole context: %s", reason)
    return groups


def size_kv_cache(runner: HFModelRunner, spec: KVCacheSpec, config: EngineConfig, max_model_len: int,
                  groups: Optional[KVCacheGroups] = None) -> int:
    """Blocks for the KV cache: explicit count, byte budget, GPU profile, or the CPU default."""
    measured = {}
    on_gpu = runner.device.type == "cuda"
    if on_gpu and config.num_kv_blocks is None and config.kv_cache_memory is None:
        measured = profile_gpu_memory(runner, config.step_token_budget(max_model_len))
    return determine_num_blocks(spec, num_kv_blocks=config.num_kv_blocks, kv_cache_memory=config.kv_cache_memory,
                                gpu_memory_utilization=config.gpu_memory_utilization,
                                device="cuda" if on_gpu else "cpu", max_num_seqs=config.max_num_seqs,
                                max_model_len=max_model_len, groups=groups,
                                chunk_tokens=config.step_token_budget(max_model_len), **measured)


def vocab_size(model: torch.nn.Module) -> int:
    embeddings = model.get_output_embeddings()
    return int(embeddings.weight.shape[0]) if embeddings is not None else int(model.config.vocab_size)


def build_hf_engine(model: torch.nn.Module, tokenizer: Any, config: EngineConfig) -> LLMEngine:
    """Switch ``model`` to kvpage attention and return an engine bound to it. If that fails
    (a ``ValueError`` naming the reason), the model keeps its own attention."""
    num_threads = configure_threads(config.num_threads)
    runner = HFModelRunner(model, onednn_linears=config.onednn_linears)
    if runner.device.type == "cpu":
        keep_freed_memory()
    # A compiled graph keeps the thread count it was compiled with (see thread_governor):
    # the governor of a compiled engine moves between this count and one thread fewer, and
    # both get their compiled entry at start-up.
    governed = runner.device.type == "cpu" and governor_wanted(config.num_threads, num_threads)
    fallback_threads = (num_threads - 1,) if governed else ()
    try:
        engine = _assemble(runner, model, tokenizer, config, fallback_threads)
        if runner.device.type == "cpu":
            engine.compute_threads = num_threads
            counts = None if runner.compiled is None else (num_threads, *fallback_threads)
            engine.thread_governor = governor_for(config.num_threads, num_threads, set_compute_threads, counts)
        return engine
    except BaseException:
        runner.restore()
        raise


def stateful_config(runner: HFModelRunner, config: EngineConfig) -> EngineConfig:
    """The settings a model with recurrent layers runs under, each change logged: no prefix
    cache (a cached block holds KV, not the state after it) and, where the model's prefill
    does not resume from a stored state, no chunked prefill. Refuses the KV tiers, which
    are prefix-cache tiers."""
    if not runner.state_layout:
        return config
    log.info("recurrent state: %d layers keep conv/recurrent state, one slot per running sequence",
             len({entry.layer for entry in runner.state_layout}))
    if config.uses_kv_tiers:
        raise ValueError("the KV tiers extend the prefix cache, which a model with recurrent layers cannot use "
                         "(its state is not rebuilt from cached KV); drop --kv-offloading-size/--kv-disk-cache")
    changes: dict = {}
    if config.enable_prefix_caching:
        changes["enable_prefix_caching"] = False
        log.info("prefix caching off: a cached block holds KV but not the recurrent state after it")
    if config.enable_chunked_prefill and not runner.chunks_resume_state:
        changes["enable_chunked_prefill"] = False
        log.info("chunked prefill off: this model's prefill starts from a zero state, so prompts run whole")
    return dataclasses.replace(config, **changes) if changes else config


class ExactLengthLimit(NamedTuple):
    tokens: int
    why: str  # a sentence ending in the limit
    bounds_steps: bool  # a step's rows count too, not only a sequence's length


def exact_length_limit(model: torch.nn.Module) -> Optional[ExactLengthLimit]:
    """The tokens up to which kvpage runs this model exactly, and why, or None when its
    length is not limited so.

    - Attention temperature tuning (Llama 4's NoPE layers scale queries by
      ``log1p(floor((p + 1) / floor_scale))``): those layers number positions from their own
      cache length, not ``position_ids``; in a kvpage step that is the row index. Below
      ``floor_scale - 1`` both give a scale of 1.
    - Doge's dynamic mask keeps only the ``keep_window_size`` keys of highest bias once a
      sequence is longer than that (its port carries the bias, densely)."""
    config = model.config.get_text_config()
    floor_scale = getattr(config, "floor_scale", None)
    if getattr(config, "attn_temperature_tuning", False) and floor_scale \
            and not all(getattr(config, "no_rope_layers", None) or [True]):  # all rotary: nothing is tuned
        tokens = int(floor_scale) - 1
        return ExactLengthLimit(tokens, "this model's attention temperature tuning counts positions itself; kvpage "
                                f"serves it exactly up to {tokens} tokens (floor_scale - 1)", True)
    if getattr(config, "model_type", None) == "doge" and getattr(config, "keep_window_size", None):
        tokens = int(config.keep_window_size)
        return ExactLengthLimit(tokens, "Doge's dynamic mask keeps only the keep_window_size keys of highest bias "
                                f"in longer sequences; kvpage serves it exactly up to {tokens} tokens", False)
    return None


def _assemble(runner: HFModelRunner, model: torch.nn.Module, tokenizer: Any, config: EngineConfig,
              other_thread_counts: tuple = ()) -> LLMEngine:
    limit = model_max_len(model)
    max_model_len = config.max_model_len or limit
    if max_model_len > limit:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's {limit} positions")
    limit_of_exactness = exact_length_limit(model)
    if limit_of_exactness is not None:
        tokens, why, bounds_steps = limit_of_exactness
        if config.max_model_len is None and max_model_len > tokens:
            log.info("max_model_len %d -> %d: %s", max_model_len, tokens, why)
            max_model_len = tokens
        if max_model_len > tokens:
            raise ValueError(f"{why}: set max_model_len to at most {tokens}")
        if bounds_steps and config.step_token_budget(max_model_len) > tokens:
            raise ValueError(f"{why}: set max_model_len and max_num_batched_tokens to at most {tokens}")
    config = stateful_config(runner, config)
    num_state_slots = config.max_num_seqs if runner.state_layout else 0
    if num_state_slots:  # before the KV is sized, so that a GPU profile counts the slots as used memory
        state_bytes = runner.allocate_state_slots(num_state_slots)
        log.info("recurrent state: %d slots, %.1f MiB", num_state_slots, state_bytes / 2**20)
    spec = kv_cache_spec(runner, config)
    backend = select_backend(config.attention_backend, runner.device)
    check_backend_fits(spec, backend.name)
    if backend.name == "cuda" and runner.uses_alibi:
        raise UnsupportedModelError("this model's attention adds ALiBi position biases, which the CUDA kernels do "
                                    "not implement (use device='cpu')")
    groups = kv_groups(spec, config)
    cache_config = config.cache_config(size_kv_cache(runner, spec, config, max_model_len, groups),
                                       spec.bytes_per_block_of(groups), max_model_len, groups.windows,
                                       num_state_slots)
    scheduler = Scheduler(cache_config, config.scheduler_config(max_model_len))
    storage = "cupy" if runner.device.type == "cuda" else "torch"
    runner.bind(PagedKVCache(spec, cache_config.num_blocks, backend=storage, groups=groups), backend)
    if not config.enforce_eager:
        if runner.eager_reason is not None:
            log.info("compilation off: %s", runner.eager_reason)
        else:
            runner.compile(config.max_num_seqs, other_thread_counts)
    eos = eos_token_ids(model, tokenizer)
    engine = LLMEngine(runner, Sampler(config.seed, eos_token_ids=eos), tokenizer, scheduler, vocab_size(model), eos)
    attach_kv_tiers(engine, config, spec, runner.kv_cache, model)
    if config.kv_events_config is not None and config.kv_events_config.publishes:
        from kvpage.engine.kv_events_publisher import attach_kv_events  # msgspec and pyzmq: the events extra

        attach_kv_events(engine, config)
    return engine
