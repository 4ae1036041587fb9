"""The closed-loop driver of the ``multi-turn`` scenario, for the paged configurations.

Conversations wait in a round-robin queue; up to ``workload.max_active`` have a turn in
flight. A turn's prompt is the conversation's history (every earlier message and the
model's replies, as a client re-sends them) plus the turn's new tokens, and it arrives the
moment it is sent, so its TTFT is first token minus send time. A finished conversation goes
to the back of the queue: between two of its turns every other conversation has one, so its
KV has to survive a working set several times the pool.

Per run it records, besides the usual traces: prompt tokens sent, prefill tokens computed
(prompt minus cached tokens), both also for turns after the first, and the mean TTFT of
those later turns (``extra``).
"""
from __future__ import annotations

from collections import deque

import numpy as np

from kvpage.tools.bench.metrics import RequestTrace, RunResult
from kvpage.tools.bench.runners.common import Clock, RunContext

_MAX_IDLE_STEPS = 100_000


def drive(ctx: RunContext, llm, result: RunResult, desc: str) -> None:
    from kvpage.core.sampling_params import SamplingParams

    engine, workload = llm.engine, ctx.workload
    turns: dict[str, deque] = {}
    for r in workload.requests:  # in turn order within each conversation
        turns.setdefault(r.conversation, deque()).append(r)
    ready, history, traces, sent = deque(turns), {c: [] for c in turns}, {}, {}
    computed = {"all": 0, "later": 0, "sent": 0, "sent_later": 0}
    ttft_later: list[float] = []
    clock, idle, done = Clock(), 0, 0
    with ctx.progress_bar(desc) as bar:
        while done < len(workload.requests):
            while ready and len(sent) < workload.max_active:
                turn = turns[ready.popleft()].popleft()
                prompt = history[turn.conversation] + list(turn.prompt_ids)
                engine.add_request(prompt, SamplingParams(max_tokens=turn.max_tokens, temperature=0.0,
                                                          ignore_eos=True), turn.request_id)
                traces[turn.request_id] = RequestTrace(turn.request_id, clock.now(), turn.max_tokens)
                sent[turn.request_id] = (turn, prompt)
            deltas = engine.step()
            now = clock.now()
            idle = 0 if deltas else idle + 1
            if idle > _MAX_IDLE_STEPS:
                raise RuntimeError("the engine made no progress: a turn can never be scheduled")
            for delta in deltas:
                trace = traces[delta.request_id]
                trace.token_times.extend([now] * len(delta.token_ids))
                trace.token_ids.extend(delta.token_ids)
            for request_id, output in engine.take_finished().items():
                turn, prompt = sent.pop(request_id)
                history[turn.conversation] = prompt + list(output.outputs[0].token_ids)
                new = len(prompt) - output.metrics.num_cached_tokens
                computed["all"] += new
                computed["sent"] += len(prompt)
                if turn.turn > 0:
                    computed["later"] += new
                    computed["sent_later"] += len(prompt)
                    times = traces[request_id].token_times
                    ttft_later.append(times[0] - traces[request_id].arrival_s)
                if turns[turn.conversation]:
                    ready.append(turn.conversation)
                done += 1
                bar.update(1)
    result.wall_s = clock.now()
    result.traces = [traces[r.request_id] for r in workload.requests]
    result.extra.update(prompt_tokens_sent=computed["sent"], prefill_tokens_computed=computed["all"],
                        later_turn_prompt_tokens_sent=computed["sent_later"],
                        later_turn_prefill_tokens_computed=computed["later"],
                        ttft_later_turns_mean_ms=1000.0 * float(np.mean(ttft_later)) if ttft_later else None)
