"""Validated configuration for the KV cache and the scheduler.

Every bad value raises ``ValueError`` naming the field, at construction time, so a
misconfigured engine never starts.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Optional, Union

from kvpage.core.kv_events import KVEventsConfig
from kvpage.core.kv_formats import KV_CACHE_DTYPES

#: Bytes a disk-tier file takes beyond its block's KV (the safetensors header), before
#: rounding up to the file system's 4 KiB allocation unit.
DISK_ENTRY_OVERHEAD_BYTES = 1024
#: Without ``kv_offloading_size``, the disk tier stages its reads through this many
#: ``max_model_len`` sequences' worth of host blocks.
DISK_STAGING_SEQS = 2
#: Default size of the disk tier (GiB) when only its directory is given.
DEFAULT_DISK_CACHE_GIB = 4.0
# What a bf16/fp16 model's oneDNN linears may compute in (EngineConfig.linear_compute_dtype).
LINEAR_COMPUTE_DTYPES = ("auto", "model", "float32")


def disk_entry_bytes(bytes_per_block: int) -> int:
    """Bytes one disk-tier file takes (its size cap's unit): KV plus header, whole 4 KiB units."""
    return -(-(bytes_per_block + DISK_ENTRY_OVERHEAD_BYTES) // 4096) * 4096


def _require_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _require_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


def check_windows(windows: object) -> tuple:
    """Each KV group's sliding window as a tuple: group 0 full attention (``None``), every
    other ``None`` or a positive integer; ``ValueError`` otherwise."""
    if isinstance(windows, (str, bytes)) or not hasattr(windows, "__iter__"):
        raise ValueError(f"group_windows must be a sequence of windows (None or a positive integer), got {windows!r}")
    windows = tuple(windows)
    if not windows or windows[0] is not None:
        raise ValueError(f"group_windows must start with a full-attention group (None), got {windows!r}")
    for window in windows[1:]:
        if window is not None:
            _require_positive_int("a sliding window", window)
    return windows


def _check_max_step_ms(value: object, enable_chunked_prefill: bool) -> None:
    if value is None:
        return
    if value != "auto" and (isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf):
        raise ValueError(f"max_step_ms must be a positive number of milliseconds or 'auto', got {value!r}")
    if not enable_chunked_prefill:
        raise ValueError("max_step_ms sizes each step's prompt chunks: it needs enable_chunked_prefill")


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Shape of the paged KV cache.

    Attributes:
        block_size: tokens per KV block; a power of two.
        num_blocks: total KV blocks in the pool.
        enable_prefix_caching: keep full blocks in the radix prefix cache after use.
        num_host_blocks: blocks of the host tier (0: none), where blocks evicted from the
            pool are kept; needs prefix caching.
        num_disk_blocks: blocks of the disk tier (0: none); needs a host tier to read through.
        enable_kv_events: record KV events (``Scheduler.take_kv_events``).
        group_windows: each KV group's sliding window (``None``: full attention), group 0
            full (``kv_groups``); one group unless the model is hybrid. The lower tiers
            need a single group.
        num_state_slots: recurrent-state slots (``state_slots``) for a model with
            state-space or linear-attention layers; 0 for attention-only models. Needs
            prefix caching off and no lower tiers.
    """

    block_size: int = 16
    num_blocks: int = 1024
    enable_prefix_caching: bool = True
    num_host_blocks: int = 0
    num_disk_blocks: int = 0
    enable_kv_events: bool = False
    group_windows: tuple = (None,)
    num_state_slots: int = 0

    def __post_init__(self) -> None:
        _require_positive_int("block_size", self.block_size)
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        _require_positive_int("num_blocks", self.num_blocks)
        for name in ("enable_prefix_caching", "enable_kv_events"):
            _require_bool(name, getattr(self, name))
        for name in ("num_host_blocks", "num_disk_blocks", "num_state_slots"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        if self.num_host_blocks and not self.enable_prefix_caching:
            raise ValueError("the KV tiers keep prefix-cache blocks: they need enable_prefix_caching")
        if self.num_disk_blocks and not self.num_host_blocks:
            raise ValueError("the disk tier reads through host memory: num_disk_blocks needs num_host_blocks")
        windows = check_windows(self.group_windows)
        object.__setattr__(self, "group_windows", windows)
        if len(windows) > 1 and self.num_host_blocks:
            raise ValueError("the lower KV tiers need a single KV group (disable the hybrid KV cache manager)")

    @property
    def num_token_slots(self) -> int:
        """Total token capacity of the pool (tokens)."""
        return self.block_size * self.num_blocks


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Limits of one iteration-level scheduling step.

    Attributes:
        max_num_seqs: most sequences in one step (the batch size cap).
        max_num_batched_tokens: token budget of one step (new tokens across all sequences).
        max_model_len: longest sequence (prompt + output, tokens) any request may reach.
        enable_chunked_prefill: split long prompts into chunks that share steps with decodes.
            Without it a prompt runs whole in one step, so it must fit the token budget.
        policy: ``"fcfs"`` (arrival order) or ``"priority"`` (lower value first, then arrival).
        max_waiting: most requests that may wait for admission; ``None`` means unbounded.
        max_preemptions_before_pin: after this many preemptions a request is pinned: it is
            never chosen as a preemption victim again, which guards against recompute thrash.
        max_step_ms: target duration of a step that runs decodes, in milliseconds: prompt
            chunks get the tokens that the step cost measured on this machine leaves within
            it after the decodes, at least one block and at most ``max_num_batched_tokens``
            (``step_budget``). A step without decodes keeps the full budget. ``"auto"``: a
            target of six times the decodes' own cost, at least 50 ms (``kvpage serve``'s
            default). ``None``: off, the static budget alone. Needs ``enable_chunked_prefill``.
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"
    max_waiting: Optional[int] = None
    max_preemptions_before_pin: int = 3
    max_step_ms: Union[float, str, None] = None

    def __post_init__(self) -> None:
        _require_positive_int("max_num_seqs", self.max_num_seqs)
        _require_positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        _require_positive_int("max_model_len", self.max_model_len)
        _require_bool("enable_chunked_prefill", self.enable_chunked_prefill)
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}")
        if self.max_waiting is not None:
            _require_positive_int("max_waiting", self.max_waiting)
        _require_positive_int("max_preemptions_before_pin", self.max_preemptions_before_pin)
        _check_max_step_ms(self.max_step_ms, self.enable_chunked_prefill)
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "max_num_batched_tokens must be >= max_model_len when enable_chunked_prefill is "
                f"off (got {self.max_num_batched_tokens} < {self.max_model_len}): a prompt must "
                "fit one step whole"
            )

    def check_against(self, cache: CacheConfig) -> None:
        """Raise ``ValueError`` if this scheduler cannot make progress with ``cache``."""
        if self.max_num_batched_tokens < cache.block_size and not self.enable_chunked_prefill:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is below one block "
                f"({cache.block_size} tokens) with chunked prefill off"
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineConfig:
    """Every engine setting, given once (vLLM's names) and passed along unchanged by ``LLM``,
    the CLI, the server and the benchmarks. Tokens are in tokens, memory in bytes.

    ``CacheConfig`` and ``SchedulerConfig`` are derived from it (``cache_config`` and
    ``scheduler_config``) once the model fixes what it must: the pool's block count and the
    model's context limit. The KV storage takes its block size from the same field, so the
    scheduler and the buffers can never disagree on it.

    Attributes:
        block_size: tokens per KV block; a power of two.
        num_kv_blocks: pool size in blocks; wins over every other sizing rule.
        kv_cache_memory: KV budget in bytes (when ``num_kv_blocks`` is not given).
        gpu_memory_utilization: share of device memory kvpage may use (GPU only).
        max_num_seqs, max_num_batched_tokens, enable_chunked_prefill, policy, max_waiting,
            max_step_ms: as in ``SchedulerConfig``.
        enable_prefix_caching: as in ``CacheConfig``.
        max_model_len: longest sequence; ``None`` takes the model's own limit.
        seed: seed of the sampler's shared random stream.
        dtype: "auto", or a torch dtype name for weights and KV.
        kv_cache_dtype: how the KV cache stores keys and values (vLLM's flag): "auto" (the
            model's dtype), "bfloat16", "float16", "float32", or a quantized format with
            per-token scales: "fp8" (= "fp8_e4m3"), "fp8_e5m2", "int8", "int4"
            (``kvpage.core.kv_formats``; docs/memory.md). A quantized format holds about 2x
            (fp8, int8) or 3.2x (int4) the tokens of bf16 in one byte budget.
        device: "auto", "cpu" or "cuda[:i]".
        attention_backend: a registered backend name, or "auto".
        exact: greedy output equal to HF ``generate`` token for token: the model runs op by
            op with torch's own linears (``enforce_eager=True, onednn_linears=False``). Off by
            default, as in vLLM: the default is the fast mode below. Contradicting it with
            ``enforce_eager=False`` or ``onednn_linears=True`` is a ``ValueError``.
        batch_invariant: every request's output, bit for bit (log-probabilities included),
            the same whatever else shares its steps and however it was scheduled: alone or
            batched, whole or in chunks, from a prefix hit or recomputed after preemption.
            The exact mode (implied) does not promise that: torch's matmuls pick their
            kernels by the batch's row count. This mode runs each ``nn.Linear`` on tiles of
            a fixed row count and every attention row through the prompt kernel
            (``docs/serving.md``). CPU only, slower than the exact mode; sampling without a
            seed still draws from one shared stream.
        enforce_eager: run the model op by op (no graph compilation, no CUDA graphs; vLLM's
            flag). ``None`` (default): compiled on CPU (``torch.compile``, cached on disk, so
            a second start compiles nothing); on GPU the forward runs eagerly and decode
            steps replay CUDA graphs captured at start-up (``captures_graphs``); eager in the
            exact mode. ``False`` on GPU also compiles the forward.
        onednn_linears: on CPU, run the model's linears through oneDNN on reordered weights.
            ``None`` (default): on, unless in the exact mode. oneDNN picks its kernels by the
            batch's row count, so a near-tie greedy token can differ with what else is in
            the batch: the reason the exact mode keeps torch's linears.
        linear_compute_dtype: the dtype a bf16/fp16 model's oneDNN linears compute in:
            "auto" (default: float32 where a float32 matmul of the model's widest weight is
            measured at least 1.15x faster at load and its float32 copy fits in memory, as on
            AVX-512 CPUs without AMX; else the model's), "model", or "float32". The weights
            stay as loaded; the reordered copy is widened, and each linear rounds its output
            to the model's dtype. "float32" turns the oneDNN linears on.
        num_threads: compute threads for the whole engine (torch and numba share them);
            ``None`` takes the CPUs this process may run on.
        kv_offloading_size: host memory for the host KV tier, in GiB (vLLM's flag and unit);
            blocks evicted from the pool are kept there. ``None``: no host tier.
        kv_disk_cache: directory of the disk KV tier, which persists across restarts.
        kv_disk_cache_size: its size cap in GiB (default ``DEFAULT_DISK_CACHE_GIB``).
        kv_events_config: publish KV events for routers (a ``KVEventsConfig``, or its dict
            or JSON form, as vLLM's ``--kv-events-config``).
        disable_hybrid_kv_cache_manager: keep every layer's KV for the whole context even in
            models with sliding-window layers (one KV group; vLLM's flag). The KV tiers imply it.
    """

    block_size: int = 16
    num_kv_blocks: Optional[int] = None
    kv_cache_memory: Optional[int] = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    max_model_len: Optional[int] = None
    policy: str = "fcfs"
    max_waiting: Optional[int] = None
    max_step_ms: Union[float, str, None] = None
    seed: int = 0
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    device: str = "auto"
    attention_backend: str = "auto"
    exact: bool = False
    batch_invariant: bool = False
    enforce_eager: Optional[bool] = None
    onednn_linears: Optional[bool] = None
    linear_compute_dtype: str = "auto"
    num_threads: Optional[int] = None
    kv_offloading_size: Optional[float] = None
    kv_disk_cache: Optional[str] = None
    kv_disk_cache_size: Optional[float] = None
    kv_events_config: Any = None
    disable_hybrid_kv_cache_manager: bool = False

    def __post_init__(self) -> None:
        CacheConfig(self.block_size, 1, self.enable_prefix_caching)  # validates block_size
        self._check_tiers()
        self._check_mode()
        _check_max_step_ms(self.max_step_ms, self.enable_chunked_prefill)
        object.__setattr__(self, "kv_events_config", KVEventsConfig.parse(self.kv_events_config))
        # Checked here too, not only by SchedulerConfig once the model is loaded: a bad
        # value must fail before the minutes a model load can take.
        for name in ("max_num_seqs", "max_num_batched_tokens", "num_kv_blocks", "kv_cache_memory",
                     "max_model_len", "num_threads", "max_waiting"):
            if getattr(self, name) is not None:
                _require_positive_int(name, getattr(self, name))
        gmu = self.gpu_memory_utilization
        if isinstance(gmu, bool) or not isinstance(gmu, (int, float)) or not 0.0 < gmu <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gmu!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if not isinstance(self.kv_cache_dtype, str) or self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; "
                             f"got {self.kv_cache_dtype!r}")

    def _check_mode(self) -> None:
        for name in ("enable_chunked_prefill", "enable_prefix_caching", "disable_hybrid_kv_cache_manager"):
            _require_bool(name, getattr(self, name))
        for name in ("exact", "batch_invariant", "enforce_eager", "onednn_linears"):
            value = getattr(self, name)
            if not (isinstance(value, bool) or (value is None and name not in ("exact", "batch_invariant"))):
                raise ValueError(f"{name} must be True or False, got {value!r}")
        if self.linear_compute_dtype not in LINEAR_COMPUTE_DTYPES:
            raise ValueError(f"linear_compute_dtype must be one of {', '.join(LINEAR_COMPUTE_DTYPES)}; "
                             f"got {self.linear_compute_dtype!r}")
        widened = self.linear_compute_dtype == "float32"
        clashes = [text for text, given in (("enforce_eager=False", self.enforce_eager is False),
                                            ("onednn_linears=True", bool(self.onednn_linears)),
                                            ("linear_compute_dtype='float32'", widened)) if given]
        for name in ("exact", "batch_invariant"):
            if getattr(self, name) and clashes:
                raise ValueError(f"{name}=True runs the model eagerly with torch's linears: it contradicts "
                                 f"{' and '.join(clashes)}")
        if widened and self.onednn_linears is False:
            raise ValueError("linear_compute_dtype='float32' widens the oneDNN linears: it contradicts "
                             "onednn_linears=False")

    @property
    def exact_mode(self) -> bool:
        """Whether settings left unset take the exact mode's values: ``exact`` or
        ``batch_invariant``, or the environment's ``KVPAGE_EXACT`` (``1``; the test suite sets
        it, so that each test compiles only when it asks to)."""
        return (self.exact or self.batch_invariant
                or os.environ.get("KVPAGE_EXACT", "0").lower() in ("1", "true", "yes"))

    def compiles(self, device_type: str) -> bool:
        """Whether the forward is compiled on a ``device_type`` ("cpu", "cuda") device."""
        if self.enforce_eager is not None:
            return not self.enforce_eager
        # On GPU the default is eager ops with graph-captured decode steps (captures_graphs).
        return device_type == "cpu" and not self.exact_mode

    def captures_graphs(self, device_type: str) -> bool:
        """Whether decode steps on a ``device_type`` device replay CUDA graphs: on GPU, unless
        ``enforce_eager`` or the exact mode (explicit ``enforce_eager=False`` included)."""
        if device_type != "cuda" or self.enforce_eager:
            return False
        return self.enforce_eager is False or not self.exact_mode

    @property
    def uses_onednn(self) -> bool:
        """Whether a CPU model's linears run through oneDNN (a no-op on GPU)."""
        if self.onednn_linears is not None:
            return self.onednn_linears
        return self.linear_compute_dtype == "float32" or not self.exact_mode

    def _check_tiers(self) -> None:
        for name in ("kv_offloading_size", "kv_disk_cache_size"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value) or value <= 0):
                raise ValueError(f"{name} must be a positive number of GiB, got {value!r}")
        if self.kv_disk_cache is not None:
            if not isinstance(self.kv_disk_cache, (str, os.PathLike)) or not str(self.kv_disk_cache):
                raise ValueError(f"kv_disk_cache must be a directory path, got {self.kv_disk_cache!r}")
            object.__setattr__(self, "kv_disk_cache", os.fspath(self.kv_disk_cache))
        elif self.kv_disk_cache_size is not None:
            raise ValueError("kv_disk_cache_size needs kv_disk_cache (the directory)")
        if (self.kv_offloading_size or self.kv_disk_cache) and not self.enable_prefix_caching:
            raise ValueError("kv_offloading_size and kv_disk_cache keep prefix-cache blocks: they need "
                             "enable_prefix_caching")

    def tier_blocks(self, bytes_per_block: int, max_model_len: int) -> tuple[int, int]:
        """(host blocks, disk blocks) the tier sizes give for blocks of ``bytes_per_block`` bytes.

        A disk tier without a host size stages its reads through ``DISK_STAGING_SEQS``
        sequences of ``max_model_len`` tokens. Raises ``ValueError`` if a size holds no block.
        """
        host = disk = 0
        if self.kv_offloading_size is not None:
            host = int(self.kv_offloading_size * 2**30) // bytes_per_block
            if host < 1:
                raise ValueError(f"kv_offloading_size={self.kv_offloading_size} GiB holds no KV block "
                                 f"of {bytes_per_block} bytes")
        if self.kv_disk_cache is not None:
            size = self.kv_disk_cache_size or DEFAULT_DISK_CACHE_GIB
            disk = int(size * 2**30) // disk_entry_bytes(bytes_per_block)
            if disk < 1:
                raise ValueError(f"kv_disk_cache_size={size} GiB holds no KV block file of "
                                 f"{disk_entry_bytes(bytes_per_block)} bytes")
            host = host or DISK_STAGING_SEQS * -(-max_model_len // self.block_size)
        return host, disk

    def step_token_budget(self, max_model_len: int) -> int:
        """Tokens per step: without chunked prefill a whole prompt must fit one step."""
        if self.enable_chunked_prefill:
            return self.max_num_batched_tokens
        return max(self.max_num_batched_tokens, max_model_len)

    @property
    def uses_kv_tiers(self) -> bool:
        return bool(self.kv_offloading_size or self.kv_disk_cache)

    @property
    def hybrid_kv_cache(self) -> bool:
        """Whether a hybrid model may get one KV group per attention kind."""
        return not self.disable_hybrid_kv_cache_manager and not self.uses_kv_tiers

    def cache_config(self, num_blocks: int, bytes_per_block: Optional[int] = None,
                     max_model_len: int = 2048, group_windows: tuple = (None,),
                     num_state_slots: int = 0) -> CacheConfig:
        """The pool of ``num_blocks`` blocks; with ``bytes_per_block``, the tiers too."""
        host, disk = self.tier_blocks(bytes_per_block, max_model_len) if bytes_per_block else (0, 0)
        events = self.kv_events_config is not None and self.kv_events_config.enable_kv_cache_events
        return CacheConfig(self.block_size, num_blocks, self.enable_prefix_caching, host, disk, events,
                           tuple(group_windows), num_state_slots)

    def scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        return SchedulerConfig(self.max_num_seqs, self.step_token_budget(max_model_len), max_model_len,
                               self.enable_chunked_prefill, self.policy, self.max_waiting,
                               max_step_ms=self.max_step_ms)
