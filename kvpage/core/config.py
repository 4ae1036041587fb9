"""Validated configuration for the KV cache and the scheduler.

Every bad value raises ``ValueError`` naming the field, at construction time, so a
misconfigured engine never starts.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


def _require_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Shape of the paged KV cache.

    Attributes:
        block_size: tokens per KV block; a power of two.
        num_blocks: total KV blocks in the pool.
        enable_prefix_caching: keep full blocks in the radix prefix cache after use.
    """

    block_size: int = 16
    num_blocks: int = 1024
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        _require_positive_int("block_size", self.block_size)
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        _require_positive_int("num_blocks", self.num_blocks)

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
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"
    max_waiting: Optional[int] = None
    max_preemptions_before_pin: int = 3

    def __post_init__(self) -> None:
        _require_positive_int("max_num_seqs", self.max_num_seqs)
        _require_positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        _require_positive_int("max_model_len", self.max_model_len)
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}")
        if self.max_waiting is not None:
            _require_positive_int("max_waiting", self.max_waiting)
        _require_positive_int("max_preemptions_before_pin", self.max_preemptions_before_pin)
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
        max_num_seqs, max_num_batched_tokens, enable_chunked_prefill, policy, max_waiting:
            as in ``SchedulerConfig``.
        enable_prefix_caching: as in ``CacheConfig``.
        max_model_len: longest sequence; ``None`` takes the model's own limit.
        seed: seed of the sampler's shared random stream.
        dtype: "auto", or a torch dtype name for weights and KV.
        device: "auto", "cpu" or "cuda[:i]".
        attention_backend: a registered backend name, or "auto".
        enforce_eager: run the model op by op (no graph compilation; vLLM's flag).
        onednn_linears: on CPU, run the model's linears through oneDNN on reordered weights
            (1.4-1.6x faster fp32 matmuls on AMD CPUs). Off by default: oneDNN's kernels
            depend on the batch's row count, so a near-tie greedy token can differ with what
            else is in the batch, and exactness against HF ``generate`` is the default.
        num_threads: compute threads for the whole engine (torch and numba share them);
            ``None`` takes the CPUs this process may run on.
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
    seed: int = 0
    dtype: str = "auto"
    device: str = "auto"
    attention_backend: str = "auto"
    enforce_eager: bool = True
    onednn_linears: bool = False
    num_threads: Optional[int] = None

    def __post_init__(self) -> None:
        CacheConfig(self.block_size, 1, self.enable_prefix_caching)  # validates block_size
        for name in ("num_kv_blocks", "kv_cache_memory", "max_model_len", "num_threads"):
            if getattr(self, name) is not None:
                _require_positive_int(name, getattr(self, name))
        gmu = self.gpu_memory_utilization
        if isinstance(gmu, bool) or not isinstance(gmu, (int, float)) or not 0.0 < gmu <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gmu!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")

    def step_token_budget(self, max_model_len: int) -> int:
        """Tokens per step: without chunked prefill a whole prompt must fit one step."""
        if self.enable_chunked_prefill:
            return self.max_num_batched_tokens
        return max(self.max_num_batched_tokens, max_model_len)

    def cache_config(self, num_blocks: int) -> CacheConfig:
        return CacheConfig(self.block_size, num_blocks, self.enable_prefix_caching)

    def scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        return SchedulerConfig(self.max_num_seqs, self.step_token_budget(max_model_len), max_model_len,
                               self.enable_chunked_prefill, self.policy, self.max_waiting)
