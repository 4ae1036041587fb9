"""The one place an engine is assembled: loads a Hugging Face model and builds an ``LLMEngine``
around it (runner, KV buffers, scheduler, sampler, KV tiers, KV event publisher, thread governor).

Every setting comes from one ``EngineConfig``; the KV storage's block size and the
scheduler's are both taken from ``config.block_size``. Every collaborator is handed to the
engine's constructor.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from kvpage.core.config import EngineConfig
from kvpage.core.kv.kv_groups import KVCacheGroups
from kvpage.core.sched.scheduler import Scheduler
from kvpage.engine.interfaces import KVEventPublisher
from kvpage.engine.llm_engine import LLMEngine
from kvpage.storage.paged_cache import PagedKVCache
from kvpage.storage.sizing import determine_num_blocks
from kvpage.storage.spec import KVCacheSpec
from kvpage.platform.malloc_tuning import keep_freed_memory
from kvpage.engine.sampler import Sampler
from kvpage.platform.thread_governor import governor_for, governor_wanted
from kvpage.platform.threads import configure_threads, set_compute_threads
from kvpage.storage.tiers import open_kv_tiers

from kvpage.adapters.attention_backends import select_backend
from kvpage.adapters.config_spec import max_positions
from kvpage.adapters.families import exact_length_limit
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

    if tokenizer is not None and not isinstance(tokenizer, (str, Path)) and not hasattr(tokenizer, "encode"):
        raise ValueError(f"tokenizer must be a tokenizer, a path or None, got {type(tokenizer).__name__}")
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
    return max_positions(model.config)


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
    """The model's per-layer KV spec, as the runner's probe forward found it, in the KV format
    ``config.kv_cache_dtype`` names (``ValueError`` if a layer's head size cannot take it)."""
    dtype = str(runner.kv_dtype).removeprefix("torch.")
    return KVCacheSpec(tuple(runner.layer_specs), config.block_size, dtype, config.kv_cache_dtype)


def check_backend_fits(spec: KVCacheSpec, backend_name: str) -> None:
    """Refuse, naming the layer, what the cache format or the backend cannot run: a quantized
    format on layers whose K and V rows differ (MLA) or that store keys only (a DSA indexer,
    which reads its keys straight from the cache); an unquantized cache in another dtype than
    the model's outside the reference backend; on CUDA, chunked attention and K and V of
    different shapes."""
    _check_format_fits(spec)
    fmt = spec.kv_format
    if not fmt.quantized and fmt.name != spec.dtype and backend_name != "reference":
        # The fast kernels attend with the query's dtype over the cache's: they must match.
        raise UnsupportedModelError(
            f"kv_cache_dtype {fmt.name} differs from the model's dtype {spec.dtype}, which the {backend_name} "
            f"attention backend does not read; use kv_cache_dtype auto (or dtype {fmt.name}), or a quantized format")
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


def _check_format_fits(spec: KVCacheSpec) -> None:
    """A quantized format's kernels read K and V rows of one shape through the attention
    backend; other layouts keep the model's dtype."""
    fmt = spec.kv_format
    if not fmt.quantized:
        return
    for i, layer in enumerate(spec.layers):
        if layer.v_head_dim == 0:
            raise UnsupportedModelError(
                f"kv_cache_dtype {fmt.name}: layer {i} stores keys only (a sparse-attention indexer reads them "
                "straight from the cache, unquantized); use kv_cache_dtype auto")
        if (layer.k_heads, layer.k_head_dim) != (layer.v_heads, layer.v_head_dim):
            raise UnsupportedModelError(
                f"kv_cache_dtype {fmt.name}: layer {i} has K [{layer.k_heads}, {layer.k_head_dim}] and V "
                f"[{layer.v_heads}, {layer.v_head_dim}] per token (MLA); quantized caches need one shape for both "
                "(use kv_cache_dtype auto)")


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


@dataclass(frozen=True, slots=True)
class BuiltEngine:
    """An assembled engine and the Hugging Face runner it drives (device, attention backend,
    KV buffers, ``restore``), which the front ends report on and hand the model back through."""

    engine: LLMEngine
    runner: HFModelRunner


def build_hf_engine(model: torch.nn.Module, tokenizer: Any, config: EngineConfig) -> BuiltEngine:
    """Switch ``model`` to kvpage attention and return an engine bound to it, with every
    collaborator the config asks for (KV tiers, KV event publisher, thread governor). If
    that fails (a ``ValueError`` naming the reason), the model keeps its own attention."""
    num_threads = configure_threads(config.num_threads)
    runner = HFModelRunner(model, onednn_linears=config.uses_onednn, linear_compute_dtype=config.linear_compute_dtype,
                           row_tiled_linears=config.batch_invariant)
    native_build = None
    if runner.device.type == "cpu":
        keep_freed_memory()
        native_build = _start_native_kernel_build()
    if runner.linear_compute is not None:
        log.info("oneDNN linears compute in %s (%s)", str(runner.linear_compute[0]).removeprefix("torch."),
                 runner.linear_compute[1])
    # Dynamo guards a compiled graph on its thread count (see thread_governor):
    # the governor of a compiled engine moves between this count and one thread fewer, and
    # both get their compiled entry at start-up.
    governed = runner.device.type == "cpu" and governor_wanted(_fixed_threads(config, num_threads), num_threads)
    fallback_threads = (num_threads - 1,) if governed else ()
    try:
        max_model_len = resolve_max_model_len(model, config)
        config = stateful_config(runner, config)
        spec, scheduler = _bind_kv_cache(runner, config, max_model_len)
        _compile(runner, config, fallback_threads)
        if native_build is not None:
            native_build.join()
        _capture_graphs(runner, config, max_model_len)
        kv_tiers = open_kv_tiers(scheduler.tiers, config, spec, runner.kv_cache, model)
        publisher = _kv_event_publisher(config, scheduler)
        threads = _engine_threads(runner, config, num_threads, fallback_threads)
        eos = eos_token_ids(model, tokenizer)
        engine = LLMEngine(runner, Sampler(config.seed, eos_token_ids=eos), tokenizer, scheduler, vocab_size(model),
                           eos, kv_tiers=kv_tiers, kv_event_publisher=publisher, **threads)
        return BuiltEngine(engine, runner)
    except BaseException:
        runner.restore()
        raise


def _start_native_kernel_build() -> threading.Thread:
    """Build (or load from the cache) the native CPU kernels in a thread while the model
    compiles: left to the first attention call, a cold build (about 15 s of g++ on two
    cores) would stall the first request instead of start-up."""
    from kvpage.kernels import native_cpu

    thread = threading.Thread(target=native_cpu.library, name="kvpage-native-build", daemon=True)
    thread.start()
    return thread


def _engine_threads(runner: HFModelRunner, config: EngineConfig, num_threads: int,
                    fallback_threads: tuple) -> dict:
    """A CPU engine's ``compute_threads`` and ``thread_governor`` (nothing on a GPU). Made
    after compilation: the governor's first look may lower the count at once."""
    if runner.device.type != "cpu":
        return {}
    counts = None if runner.compiled is None else (num_threads, *fallback_threads)
    return {"compute_threads": num_threads,
            "thread_governor": governor_for(_fixed_threads(config, num_threads), num_threads, set_compute_threads,
                                            counts)}


def _fixed_threads(config: EngineConfig, num_threads: int) -> Optional[int]:
    """The thread count the engine must keep (no governor), or None: the user's, or in the
    batch-invariant mode the one resolved (a matmul's kernel may follow the count)."""
    return num_threads if config.batch_invariant else config.num_threads


def _kv_event_publisher(config: EngineConfig, scheduler: Scheduler) -> Optional[KVEventPublisher]:
    """A started publisher when the config publishes KV events; its first batch lists what
    the disk tier restored (so open the tiers first)."""
    if config.kv_events_config is None or not config.kv_events_config.publishes:
        return None
    from kvpage.engine.kv_events_publisher import open_publisher  # msgspec and pyzmq: the events extra

    return open_publisher(config.kv_events_config, scheduler.take_kv_events())


def stateful_config(runner: HFModelRunner, config: EngineConfig) -> EngineConfig:
    """The settings a model with recurrent layers runs under, each change logged: no prefix
    cache (a cached block holds KV, not the state after it) and, where the model's prefill
    does not resume from a stored state, no chunked prefill (nor the step-time target, which
    sizes chunks). Refuses the KV tiers, which are prefix-cache tiers."""
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
        if config.max_step_ms is not None:  # a step target sizes prompt chunks: with none, it has no say
            changes["max_step_ms"] = None
            log.info("step-time target (max_step_ms=%s) off: it needs chunked prefill", config.max_step_ms)
    return dataclasses.replace(config, **changes) if changes else config


def resolve_max_model_len(model: torch.nn.Module, config: EngineConfig) -> int:
    """``config.max_model_len`` (default: the model's positions), checked against the model's
    positions and, where kvpage serves the model exactly only up to some length, lowered to
    it (logged) or refused."""
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
    return max_model_len


def _bind_kv_cache(runner: HFModelRunner, config: EngineConfig, max_model_len: int) -> tuple[KVCacheSpec, Scheduler]:
    """Size the KV cache, allocate it (and any recurrent state slots), bind it and the
    attention backend to ``runner``; returns the KV spec and a scheduler over those blocks."""
    num_state_slots = config.max_num_seqs if runner.state_layout else 0
    if num_state_slots:  # before the KV is sized, so that a GPU profile counts the slots as used memory
        state_bytes = runner.allocate_state_slots(num_state_slots)
        log.info("recurrent state: %d slots, %.1f MiB", num_state_slots, state_bytes / 2**20)
    spec = kv_cache_spec(runner, config)
    backend = select_backend(config.attention_backend, runner.device, spec.cache_format,
                             batch_invariant=config.batch_invariant)
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
    return spec, scheduler


def _capture_graphs(runner: HFModelRunner, config: EngineConfig, max_model_len: int) -> None:
    """Capture the decode steps in CUDA graphs where the config asks for them and the model
    allows; a capture that fails (or replays unlike its eager forward) is logged and the
    steps run eagerly."""
    if not config.captures_graphs(runner.device.type):
        return
    reason = runner.graph_refusal()
    if reason is not None:
        log.info("CUDA graphs off: %s", reason)
        return
    try:
        seconds = runner.capture_decode_graphs(config.max_num_seqs, max_model_len)
    except Exception as exc:  # noqa: BLE001 - the driver's refusal or a failed check: eager is still correct
        runner.decode_graphs = None
        log.warning("CUDA graphs off, decode steps run eagerly: capture failed (%s: %s)", type(exc).__name__, exc)
        return
    sizes = runner.decode_graphs.sizes
    log.info("decode steps of 1-%d sequences captured in %d CUDA graphs in %.1f s", sizes[-1], len(sizes), seconds)


def _compile(runner: HFModelRunner, config: EngineConfig, other_thread_counts: tuple) -> None:
    """Compile the forward unless the config or the model rules it out (logged)."""
    if not config.compiles(runner.device.type):
        return
    if runner.eager_reason is not None:
        log.info("compilation off: %s", runner.eager_reason)
    else:
        runner.compile(config.max_num_seqs, other_thread_counts)
