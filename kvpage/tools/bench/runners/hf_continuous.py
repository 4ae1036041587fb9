"""Configuration B: Hugging Face's own continuous batching (``ContinuousBatchingManager``).

Each request is added with its own ``max_new_tokens`` at its arrival time; the KV cache
gets the same byte budget as the paged configurations (``num_blocks`` pages of
``block_size`` tokens over all layers) and the same per-step token budget and sequence
cap. HF's defaults are otherwise kept (including its prefix block sharing). As A and the
paged configurations do, B first runs two short requests untimed (``_warm_up``), so that
lazy initialisation on the manager's first steps stays out of the timing. Its
scheduler runs in a background thread, so concurrency is *sampled* from the main thread
while polling for results, and per-step KV waste is not exposed (reported as missing).
"""
from __future__ import annotations

import time

from kvpage.tools.bench.metrics import RunResult
from kvpage.tools.bench.runners.common import Clock, RunContext

LABEL = "HF continuous batching"
_POLL_S = 0.005
_WARM_UP_TIMEOUT_S = 300.0


def _configs(ctx: RunContext):
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    gen = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0,
                           max_new_tokens=max(r.max_tokens for r in ctx.workload.requests))
    cb = ContinuousBatchingConfig(page_size=ctx.block_size, num_blocks=ctx.num_kv_blocks,
                                  max_batch_tokens=ctx.token_budget, max_requests_per_batch=ctx.max_num_seqs)
    return gen, cb


def _active(manager) -> int:
    processor = getattr(manager, "batch_processor", None)
    scheduler = getattr(processor, "scheduler", None)
    return len(getattr(scheduler, "active_requests", {}) or {})


def _warm_up(manager, vocab: int) -> None:
    """Two short requests through ``manager``, waited for (``RuntimeError`` if the manager's
    thread stops or ``_WARM_UP_TIMEOUT_S`` passes first)."""
    pending = set()
    for n in (5, 21):
        request_id = f"warm-up-{n}"
        manager.add_request([3 + (i % (vocab - 3)) for i in range(n)], request_id=request_id, max_new_tokens=3,
                            eos_token_id=-1)
        pending.add(request_id)
    deadline = time.perf_counter() + _WARM_UP_TIMEOUT_S
    while pending:
        out = manager.get_result(timeout=_POLL_S)
        if out is not None and out.is_finished():
            pending.discard(out.request_id)
        elif out is None and (not manager.is_running() or time.perf_counter() > deadline):
            raise RuntimeError("the HF continuous batching warm-up did not finish")


def _drive(ctx: RunContext, manager, result: RunResult) -> None:
    requests, traces, clock = ctx.workload.requests, ctx.new_traces(), Clock()
    added = done = 0
    with ctx.progress_bar(f"B {LABEL}") as bar:
        while done < len(requests):
            while added < len(requests) and requests[added].arrival_s <= clock.now():
                r = requests[added]
                manager.add_request(list(r.prompt_ids), request_id=r.request_id, max_new_tokens=r.max_tokens,
                                    record_timestamps=True, eos_token_id=-1)
                added += 1
            out = manager.get_result(timeout=_POLL_S)
            result.concurrency_samples.append(_active(manager))
            if out is None or not out.is_finished():
                if out is None and not manager.is_running():
                    raise RuntimeError("the HF continuous batching thread stopped")
                continue
            if out.error is not None:
                raise RuntimeError(f"HF continuous batching failed request {out.request_id}: {out.error}")
            trace = traces[out.request_id]
            trace.token_times = [clock.relative(t) for t in (out.timestamps or [])][: trace.max_tokens]
            trace.token_ids = list(out.generated_tokens)[: trace.max_tokens]
            done += 1
            bar.update(1)
    result.wall_s = clock.now()
    result.traces = list(traces.values())


def run(ctx: RunContext) -> RunResult:
    """Run B, or return it skipped with the reason when this transformers has no usable CB."""
    model = ctx.model
    if ctx.workload.closed_loop:
        return RunResult.skipped("B", LABEL, "closed-loop conversations: run by the paged configurations only")
    if not hasattr(model, "continuous_batching_context_manager"):
        return RunResult.skipped("B", LABEL, "this transformers version has no continuous batching API")
    import transformers

    original_attn = model.config._attn_implementation
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    result = RunResult("B", LABEL)
    try:
        gen, cb = _configs(ctx)
        with model.continuous_batching_context_manager(generation_config=gen, continuous_batching_config=cb,
                                                       block=True, timeout=30) as manager:
            _warm_up(manager, ctx.loaded.vocab_size)
            _drive(ctx, manager, result)
    except Exception as exc:  # noqa: BLE001 - a baseline that cannot run here is reported, not faked
        return RunResult.skipped("B", LABEL, f"{type(exc).__name__}: {exc}")
    finally:
        transformers.logging.set_verbosity(verbosity)
        if model.config._attn_implementation != original_attn:
            model.set_attn_implementation(original_attn)
    result.extra["concurrency_sampled"] = True
    return result
