"""Configuration A: HF ``generate`` with static batching and a static (pre-allocated) KV cache.

The KV budget buys ``B = budget // (bytes per token * max_len)`` sequences, each reserved
at the workload's maximum length (what a static server must do: it cannot know a
request's length up front). Requests run in FCFS batches of up to ``B``: a batch starts
when the previous one ends, with the requests that have arrived by then (or the next one
to arrive), left-padded to its longest prompt, and runs until its longest request is done.

KV waste per step = 1 - live tokens / (B * max_len), where live tokens are the prompt and
useful output tokens of requests still producing useful tokens; padding, tokens past a
request's own ``max_tokens`` and slots of finished or absent rows are waste.
"""
from __future__ import annotations

from collections import deque

import numpy as np

from kvpage.tools.bench.metrics import RequestTrace, RunResult
from kvpage.tools.bench.runners.common import Clock, RunContext

LABEL = "HF static batching"


class _StepTimes:
    """A ``generate`` streamer that only records when each decoding step's tokens appear."""

    def __init__(self, clock: Clock) -> None:
        self.clock, self.times, self._seen_prompt = clock, [], False

    def put(self, value) -> None:
        if self._seen_prompt:  # the first call carries the prompt, not a new token
            self.times.append(self.clock.now())
        self._seen_prompt = True

    def end(self) -> None:
        pass


def batch_size(ctx: RunContext) -> int:
    return ctx.kv_budget_bytes // (ctx.loaded.kv_bytes_per_token * ctx.max_len)


def _run_batch(ctx: RunContext, batch: list, clock: Clock, traces: dict[str, RequestTrace], cache_impl: str):
    import torch

    model = ctx.model
    width = max(len(r.prompt_ids) for r in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros(len(batch), width, dtype=torch.long)
    for row, r in enumerate(batch):  # left padding: every prompt ends at the last column
        ids[row, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
        mask[row, width - len(r.prompt_ids):] = 1
    new = max(r.max_tokens for r in batch)
    streamer = _StepTimes(clock)
    out = _generate(model, ids, mask, new, _cache(model, ctx.max_len, cache_impl), streamer)
    generated = out[:, width:].tolist()
    for row, r in enumerate(batch):
        traces[r.request_id].token_times = streamer.times[: r.max_tokens]
        traces[r.request_id].token_ids = generated[row][: r.max_tokens]
    return _waste(ctx, batch, len(streamer.times))


def _cache(model, max_len: int, cache_impl: str):
    """A ``StaticCache`` reserving ``max_len`` slots per row, or None (HF's growing DynamicCache)."""
    if cache_impl == "dynamic":
        return None
    from transformers import StaticCache

    return StaticCache(config=model.config, max_cache_len=max_len)


def _generate(model, ids, mask, new: int, cache, streamer=None):
    import torch

    extra = {} if cache is None else {"cache": cache}
    with torch.inference_mode():
        return model.generate(ids.to(model.device), attention_mask=mask.to(model.device), max_new_tokens=new,
                              min_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0,
                              streamer=streamer, **extra)


def _waste(ctx: RunContext, batch: list, steps: int) -> np.ndarray:
    """Per-step waste fraction of the ``B * max_len`` reserved slots (see module docstring)."""
    lens = np.array([len(r.prompt_ids) for r in batch])[None, :]
    limits = np.array([r.max_tokens for r in batch])[None, :]
    step = np.arange(steps)[:, None]
    live = np.where(step < limits, lens + step + 1, 0).sum(axis=1)
    return 1.0 - live / float(batch_size(ctx) * ctx.max_len)


def run(ctx: RunContext, cache_impl: str = "static") -> RunResult:
    """Run A. ``cache_impl="dynamic"`` uses HF's default growing cache instead (same batching)."""
    import torch

    if ctx.workload.closed_loop:
        return RunResult.skipped("A", LABEL, "closed-loop conversations: run by the paged configurations only")
    size = batch_size(ctx)
    if size < 1:
        return RunResult.skipped("A", LABEL, f"the KV budget holds no sequence of {ctx.max_len} tokens")
    result, traces = RunResult("A", LABEL, num_preemptions=0), ctx.new_traces()
    warm = torch.full((1, 4), 3, dtype=torch.long)  # lazy initialisation stays out of the timing
    _generate(ctx.model, warm, torch.ones_like(warm), 2, _cache(ctx.model, ctx.max_len, cache_impl))
    pending, clock = deque(ctx.workload.requests), Clock()
    with ctx.progress_bar(f"A {LABEL}") as bar:
        while pending:
            clock.sleep_until(pending[0].arrival_s)
            batch = [pending.popleft()]
            while pending and len(batch) < size and pending[0].arrival_s <= clock.now():
                batch.append(pending.popleft())
            waste = _run_batch(ctx, batch, clock, traces, cache_impl)
            result.kv_waste_samples.extend(waste.tolist())
            result.concurrency_samples.extend([len(batch)] * len(waste))
            bar.update(len(batch))
    result.wall_s = clock.now()
    result.traces = list(traces.values())
    result.extra.update(static_batch_size=size, cache_impl=cache_impl)
    return result
