"""Configurations C, D, E, F, G: kvpage paged attention with continuous batching.

C: chunked prefill off (a prompt runs whole in one step, so the step budget must hold the
longest prompt); D: C + chunked prefill (``token_budget`` tokens per step, decodes
first); E: D + prefix caching; F: E + the tiered prefix cache, a host tier of
``F_HOST_SHARE`` times the pool's bytes and a disk tier (a fresh temporary folder, so
nothing carries over between runs) of ``F_DISK_SHARE`` times; G: E without hybrid KV groups
(every layer keeps the whole context, as on a model without sliding windows). All get
``kv_budget_bytes`` as their KV budget (as many blocks as fit, which with hybrid groups are
smaller blocks).

KV waste per step = the pool's fragmentation when the step is scheduled: the fraction of
token slots in blocks referenced by live requests that hold no token (the partly filled
last block of each sequence). Free and cached-idle blocks are not reserved by anyone.
Requests join the engine at their arrival times; closed-loop workloads (``multi-turn``)
are driven by ``multi_turn.drive``.
"""
from __future__ import annotations

import shutil
import tempfile
import time
from typing import TYPE_CHECKING, Optional

from kvpage.tools.bench.metrics import RunResult
from kvpage.tools.bench.runners import multi_turn
from kvpage.tools.bench.runners.common import Clock, RunContext

if TYPE_CHECKING:
    from kvpage.core.config import EngineConfig

LABELS = {"C": "kvpage paged, no chunked prefill", "D": "kvpage paged + chunked prefill",
          "E": "kvpage paged + chunked + prefix cache", "F": "E + host and disk KV tiers",
          "G": "E without hybrid KV groups"}
F_HOST_SHARE = 8
F_DISK_SHARE = 16
_MAX_IDLE_STEPS = 10_000


def engine_config(ctx: RunContext, config: str, disk_dir: Optional[str] = None,
                  enforce_eager: bool = True) -> "EngineConfig":
    """The engine settings of configuration ``config`` (C, D, E, G, or F with its disk folder);
    ``enforce_eager=False`` compiles the model (``torch.compile``) at start-up."""
    from kvpage.core.config import EngineConfig

    chunked = config in ("D", "E", "F", "G")
    budget = ctx.token_budget if chunked else max(ctx.unchunked_token_budget, ctx.max_len)
    tiers = {}
    if config == "F":
        pool_gib = ctx.num_kv_blocks * ctx.block_size * ctx.loaded.kv_bytes_per_token / 2**30
        tiers = dict(kv_offloading_size=F_HOST_SHARE * pool_gib, kv_disk_cache=disk_dir,
                     kv_disk_cache_size=F_DISK_SHARE * pool_gib)
    return EngineConfig(kv_cache_memory=ctx.kv_budget_bytes, block_size=ctx.block_size,
                        max_num_seqs=ctx.max_num_seqs, max_num_batched_tokens=budget, enable_chunked_prefill=chunked,
                        enable_prefix_caching=config in ("E", "F", "G"), max_model_len=ctx.max_len, seed=ctx.seed,
                        onednn_linears=True, disable_hybrid_kv_cache_manager=config == "G",
                        enforce_eager=enforce_eager, kv_cache_dtype=ctx.kv_cache_dtype, **tiers)


def build_llm(ctx: RunContext, config: str, disk_dir: Optional[str] = None, enforce_eager: bool = True):
    """An ``LLM`` over ``ctx.model`` for configuration ``config`` (C, D, E, F or G)."""
    from kvpage.entrypoints.llm import LLM

    return LLM(ctx.model, config=engine_config(ctx, config, disk_dir, enforce_eager))


def _warm_up(llm, vocab: int) -> None:
    """One short generate so lazy initialisation / JIT compilation stays out of the timing."""
    from kvpage.core.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    llm.generate([[3 + (i % (vocab - 3)) for i in range(n)] for n in (5, 21)], params, use_tqdm=False)


def _instrument(engine, result: RunResult) -> None:
    """Record each step's batch size and the pool's fragmentation as it is scheduled."""
    def record(output) -> None:
        result.concurrency_samples.append(len(output.requests))
        result.kv_waste_samples.append(engine.kv_fragmentation)

    engine.add_step_observer(record)


def _drive(ctx: RunContext, llm, result: RunResult, desc: str) -> None:
    from kvpage.core.sampling_params import SamplingParams

    engine, requests, traces = llm.engine, ctx.workload.requests, ctx.new_traces()
    added = done = idle = 0
    clock = Clock()
    with ctx.progress_bar(desc) as bar:
        while done < len(requests):
            while added < len(requests) and requests[added].arrival_s <= clock.now():
                r = requests[added]
                engine.add_request(list(r.prompt_ids), SamplingParams(max_tokens=r.max_tokens, temperature=0.0,
                                                                      ignore_eos=True), r.request_id)
                added += 1
            if not engine.has_unfinished_requests():
                clock.sleep_until(requests[added].arrival_s)
                continue
            deltas = engine.step()
            now = clock.now()
            idle = 0 if deltas else idle + 1
            if idle > _MAX_IDLE_STEPS:
                raise RuntimeError("the engine made no progress: a request can never be scheduled")
            for delta in deltas:  # bookkeeping per sequence of the step, not per token of the run
                trace = traces[delta.request_id]
                trace.token_times.extend([now] * len(delta.token_ids))
                trace.token_ids.extend(delta.token_ids)
            finished = engine.take_finished()
            done += len(finished)
            bar.update(len(finished))
    result.wall_s = clock.now()
    result.traces = list(traces.values())


def run(ctx: RunContext, config: str, replay: bool = False, enforce_eager: bool = True) -> RunResult:
    """Run configuration ``config`` (compiled with ``enforce_eager=False``). With ``replay``,
    also time the run's recorded steps through the bare model (``extra["bare_forward_s"]``,
    see ``replay_forward_s``)."""
    disk_dir = tempfile.mkdtemp(prefix="kvpage-bench-kv-") if config == "F" else None
    llm = build_llm(ctx, config, disk_dir, enforce_eager)
    try:
        _warm_up(llm, ctx.loaded.vocab_size)
        engine = llm.engine
        engine.reset_step_stats()
        before = engine.stats()
        result = RunResult(config, LABELS[config])
        _instrument(engine, result)
        steps = _Steps()
        if replay:
            _record_metadata(llm.runner, steps)
        drive = multi_turn.drive if ctx.workload.closed_loop else _drive
        drive(ctx, llm, result, f"{config} {LABELS[config]}")
        after = engine.stats()
        if replay:
            del llm.runner.execute  # drop the recording wrapper: replay runs the plain method
            # Best of two replays: the machine is shared, and the minimum is the least disturbed.
            result.extra["bare_forward_s"] = min(replay_forward_s(llm, steps) for _ in range(2))
            result.extra["forward_in_run_s"] = steps.forward_s
    finally:
        llm.close()
        llm.restore()
        if disk_dir is not None:
            shutil.rmtree(disk_dir, ignore_errors=True)
    result.num_preemptions = after["num_preemptions"] - before["num_preemptions"]
    result.prefix_queried_tokens = after["prefix_cache_queries"] - before["prefix_cache_queries"]
    result.prefix_hit_tokens = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    result.extra.update(num_kv_blocks=after["num_blocks"], num_steps=after["num_steps"])
    if config == "F":
        result.extra.update({key: after[key] - before.get(key, 0) for key in (
            "kv_pool_hit_tokens", "kv_host_hit_tokens", "kv_disk_hit_tokens", "kv_host_evictions",
            "kv_disk_written_bytes")})
    return result


class _Steps(list):
    """Recorded step metadata, plus the seconds ``execute`` took for them during the run."""

    forward_s: float = 0.0


def _record_metadata(runner, sink: _Steps) -> None:
    execute = runner.execute

    def recording_execute(metadata):
        sink.append(metadata)
        start = time.perf_counter()
        logits = execute(metadata)
        sink.forward_s += time.perf_counter() - start
        return logits

    runner.execute = recording_execute


def replay_forward_s(llm, steps: list) -> float:
    """Seconds to run ``steps`` (recorded metadata) through the model back to back: no
    scheduling, sampling or bookkeeping, the same batch shapes and KV traffic."""
    import torch

    runner = llm.runner
    sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    with torch.inference_mode():
        for metadata in steps:
            runner.execute(metadata)
    sync()
    return time.perf_counter() - start
