"""Seeded synthetic workloads: prompt/output lengths, per-request max_tokens, arrival times.

Lengths are log-normal, the shape ShareGPT conversations have (a long right tail; the
median well below the mean), scaled down by ``Scale`` so a 2-core CPU finishes quickly.
Prompts are random token ids (no tokenizer is needed); generation is greedy with EOS
ignored, so every configuration produces exactly ``max_tokens`` useful tokens per request.
All times are seconds from the start of a run.

``multi-turn`` is closed-loop: each request is one turn of a conversation, and its prompt
is only known once the previous turn has answered (the whole history so far, the model's
replies included, plus the new message). Its ``BenchRequest.prompt_ids`` hold a turn's
new tokens only; the runner builds the full prompt (``runners/multi_turn.py``).

``long-context`` runs on a model of its own (``Workload.model``: a Gemma3-pattern model,
five sliding-window layers to one full one), with prompts many windows long and a pool
sized for a few of them without hybrid KV groups.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

SCENARIOS = ("sharegpt", "burst", "shared-prefix", "multi-turn", "long-context")
FIRST_TOKEN_ID = 3  # ids 0-2 are pad/bos/eos in the random models; keep prompts clear of them


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One request: prompt token ids, its own output length, its arrival time (s).

    In a multi-turn workload: ``conversation`` and ``turn`` (0-based) place it, and
    ``prompt_ids`` are the tokens the turn adds to the history.
    """

    request_id: str
    prompt_ids: tuple[int, ...]
    max_tokens: int
    arrival_s: float = 0.0
    conversation: str = ""
    turn: int = 0


@dataclass(frozen=True, slots=True)
class Workload:
    """An ordered (FCFS by arrival) list of requests and what it needs from a cache."""

    name: str
    requests: tuple[BenchRequest, ...]
    description: str = ""
    closed_loop: bool = False  # multi-turn: a turn is sent when the previous one has answered
    max_active: int = 0  # closed loop: conversations with a turn in flight at once
    kv_budget_tokens: Optional[int] = None  # the pool this scenario is sized for (tokens)
    model: Optional[str] = None  # the model this scenario needs, if not the suite's

    @property
    def max_len(self) -> int:
        """Longest prompt + longest output, in tokens: what a static cache reserves per sequence.

        (A left-padded batch may pair the longest prompt with the longest output; a
        conversation's last turn holds its whole history.)
        """
        if self.closed_loop:
            return max(self.history_lengths().values())
        return max(len(r.prompt_ids) for r in self.requests) + max(r.max_tokens for r in self.requests)

    def history_lengths(self) -> dict[str, int]:
        """Closed loop: each conversation's tokens after its last turn (messages and replies)."""
        totals: dict[str, int] = {}
        for r in self.requests:
            totals[r.conversation] = totals.get(r.conversation, 0) + len(r.prompt_ids) + r.max_tokens
        return totals

    @property
    def num_useful_tokens(self) -> int:
        return sum(r.max_tokens for r in self.requests)

    @property
    def is_online(self) -> bool:
        return any(r.arrival_s > 0 for r in self.requests)


@dataclass(frozen=True, slots=True)
class Scale:
    """Workload size knobs (tokens, counts, requests/s). ``arrival_rate`` 0 = all at t=0."""

    num_requests: int = 24
    prompt_median: int = 48
    prompt_sigma: float = 0.9
    output_median: int = 24
    output_sigma: float = 0.7
    max_prompt: int = 256
    max_output: int = 64
    arrival_rate: float = 20.0
    burst_decoders: int = 16
    burst_long_prompts: int = 3
    burst_long_len: int = 256
    burst_gap_s: float = 0.3
    system_prompt_len: int = 256
    question_median: int = 16
    conversations: int = 16
    turns: int = 8
    context_len: int = 1536
    user_len: int = 16
    reply_len: int = 32
    max_active: int = 3
    long_requests: int = 32
    long_prompt_median: int = 1536
    long_max_prompt: int = 2560
    long_output: int = 256  # long enough that memory, not the prefill rate, bounds concurrency
    long_pool_seqs: int = 3


SCALES = {
    "tiny": Scale(num_requests=8, prompt_median=12, output_median=6, max_prompt=32, max_output=12,
                  arrival_rate=200.0, burst_decoders=4, burst_long_prompts=1, burst_long_len=40, burst_gap_s=0.01,
                  system_prompt_len=32, question_median=6, conversations=4, turns=3, context_len=24, user_len=4,
                  reply_len=4, max_active=1, long_requests=6, long_prompt_median=384, long_max_prompt=448,
                  long_output=24, long_pool_seqs=2),
    # Small but busy: more requests arrive at once than A's static batch holds, so the quick
    # chart still shows A's concurrency wall against the paged configurations.
    "quick": Scale(num_requests=32, prompt_median=24, output_median=12, max_prompt=128, max_output=32,
                   arrival_rate=100.0, burst_decoders=24, burst_long_prompts=2, burst_long_len=128, burst_gap_s=0.2,
                   system_prompt_len=128, question_median=12, conversations=8, turns=4, context_len=256,
                   user_len=12, reply_len=16, max_active=2, long_requests=8, long_prompt_median=768,
                   long_max_prompt=1024, long_output=96),
    # Enough requests, arriving fast enough, for paged batching to outgrow static's batch.
    "cpu": Scale(num_requests=64, arrival_rate=40.0, burst_decoders=32, burst_long_prompts=4),
    # The A/B/C/D step of benchmarks/gpu_check.sh (an 8B model on one GPU within about two
    # minutes, start-up included): ShareGPT-shaped lengths cut short, every request at t=0, so
    # tok/s is the throughput at saturation and concurrency is bounded by the KV budget.
    "gpu-check": Scale(num_requests=64, prompt_median=160, prompt_sigma=1.0, output_median=32, output_sigma=0.8,
                       max_prompt=768, max_output=128, arrival_rate=0.0),
    # Published-benchmark sizes: ShareGPT-like lengths (median prompt ~200, output ~150) and a 1k system prompt.
    "full": Scale(num_requests=400, prompt_median=200, prompt_sigma=1.0, output_median=150, output_sigma=0.8,
                  max_prompt=1536, max_output=512, arrival_rate=20.0, burst_decoders=128, burst_long_prompts=8,
                  burst_long_len=1536, burst_gap_s=0.5, system_prompt_len=1024, question_median=48,
                  conversations=64, turns=10, context_len=2048, user_len=64, reply_len=128, max_active=16,
                  long_requests=64, long_prompt_median=6144, long_max_prompt=7936, long_output=512, long_pool_seqs=8),
}


def _lognormal(rng: np.random.Generator, median: int, sigma: float, count: int, low: int, high: int) -> np.ndarray:
    values = rng.lognormal(mean=np.log(median), sigma=sigma, size=count)
    return np.clip(np.rint(values), low, high).astype(np.int64)


def _arrivals(rng: np.random.Generator, count: int, rate: float) -> np.ndarray:
    """Poisson process: exponential gaps of mean 1/rate, the first request at t=0."""
    if rate <= 0:
        return np.zeros(count)
    gaps = rng.exponential(1.0 / rate, size=count)
    gaps[0] = 0.0
    return np.cumsum(gaps)


def _prompt(rng: np.random.Generator, length: int, vocab: int) -> tuple[int, ...]:
    return tuple(int(t) for t in rng.integers(FIRST_TOKEN_ID, vocab, size=length))


def sharegpt(scale: Scale, vocab: int, seed: int, rate: Optional[float] = None) -> Workload:
    """Mixed conversation-like lengths; optional Poisson arrivals (``rate`` overrides the scale)."""
    rng = np.random.default_rng(seed)
    n = scale.num_requests
    prompts = _lognormal(rng, scale.prompt_median, scale.prompt_sigma, n, 4, scale.max_prompt)
    outputs = _lognormal(rng, scale.output_median, scale.output_sigma, n, 2, scale.max_output)
    times = _arrivals(rng, n, scale.arrival_rate if rate is None else rate)
    requests = tuple(BenchRequest(f"s{i}", _prompt(rng, int(p), vocab), int(o), float(t))
                     for i, (p, o, t) in enumerate(zip(prompts, outputs, times)))
    return Workload("sharegpt", requests, "log-normal prompt/output lengths, ShareGPT-like shape")


def burst(scale: Scale, vocab: int, seed: int) -> Workload:
    """Many short-prompt decoders start at t=0; long prompts land while they decode."""
    rng = np.random.default_rng(seed + 1)
    k = scale.burst_decoders
    outputs = _lognormal(rng, scale.max_output // 2, 0.2, k, 8, scale.max_output)
    decoders = [BenchRequest(f"d{i}", _prompt(rng, int(rng.integers(4, 16)), vocab), int(o))
                for i, o in enumerate(outputs)]
    # Long prompts arrive every ``burst_gap_s`` while the decoders run; their outputs are short.
    longs = [BenchRequest(f"L{j}", _prompt(rng, scale.burst_long_len, vocab), 8, scale.burst_gap_s * (j + 1))
             for j in range(scale.burst_long_prompts)]
    return Workload("burst", tuple(decoders + longs), "long prompts arriving while many requests decode")


def shared_prefix(scale: Scale, vocab: int, seed: int, rate: Optional[float] = None) -> Workload:
    """One system prompt shared by every request, plus a short distinct question."""
    rng = np.random.default_rng(seed + 2)
    n = scale.num_requests
    system = _prompt(rng, scale.system_prompt_len, vocab)
    questions = _lognormal(rng, scale.question_median, 0.5, n, 2, 4 * scale.question_median)
    outputs = _lognormal(rng, scale.output_median, scale.output_sigma, n, 2, scale.max_output)
    times = _arrivals(rng, n, scale.arrival_rate if rate is None else rate)
    requests = tuple(BenchRequest(f"p{i}", system + _prompt(rng, int(q), vocab), int(o), float(t))
                     for i, (q, o, t) in enumerate(zip(questions, outputs, times)))
    return Workload("shared-prefix", requests, f"{len(system)}-token shared system prompt + short questions")


#: The multi-turn pool holds this share of all conversations' final histories (or, if more,
#: 1.25x the ``max_active`` longest ones), so the working set is several times the pool.
MULTI_TURN_POOL_SHARE = 0.25


def multi_turn(scale: Scale, vocab: int, seed: int) -> Workload:
    """Conversations: a distinct context (a document, an agent's state), then turns of a short
    user message each, every turn re-sending the whole history; closed loop, round robin."""
    rng = np.random.default_rng(seed + 3)
    requests = []
    for c in range(scale.conversations):
        for t in range(scale.turns):
            head = _prompt(rng, scale.context_len, vocab) if t == 0 else ()
            requests.append(BenchRequest(f"c{c}t{t}", head + _prompt(rng, scale.user_len, vocab), scale.reply_len,
                                         conversation=f"c{c}", turn=t))
    workload = Workload("multi-turn", tuple(requests), closed_loop=True, max_active=scale.max_active)
    histories = workload.history_lengths()
    pool = max(int(MULTI_TURN_POOL_SHARE * sum(histories.values())), -(-5 * scale.max_active * workload.max_len // 4))
    description = (f"{scale.conversations} conversations x {scale.turns} turns ({scale.context_len}-token context, "
                   f"{scale.user_len}-token messages, {scale.reply_len}-token replies), each turn re-sending the "
                   f"history; {scale.max_active} in flight; histories total {sum(histories.values())} tokens, "
                   f"{sum(histories.values()) / pool:.1f}x the pool")
    return Workload("multi-turn", tuple(requests), description, closed_loop=True, max_active=scale.max_active,
                    kv_budget_tokens=pool)


#: The model of ``long-context`` (``model.RANDOM_SIZES``): five sliding layers to one full.
LONG_CONTEXT_MODEL = "random-gemma3"
#: Scenarios that run on a model of their own rather than the suite's.
SCENARIO_MODELS = {"long-context": LONG_CONTEXT_MODEL}


def long_context(scale: Scale, vocab: int, seed: int) -> Workload:
    """Long prompts (many sliding windows each) all at t=0, a pool for ``long_pool_seqs`` of
    them at full length without hybrid KV groups: what hybrid memory buys is concurrency."""
    rng = np.random.default_rng(seed + 4)
    count = scale.long_requests
    lengths = _lognormal(rng, scale.long_prompt_median, 0.25, count, scale.long_prompt_median // 2,
                         scale.long_max_prompt)
    requests = tuple(BenchRequest(f"l{i}", _prompt(rng, int(n), vocab), scale.long_output)
                     for i, n in enumerate(lengths))
    longest = int(lengths.max()) + scale.long_output
    pool = scale.long_pool_seqs * longest
    description = (f"{count} prompts of median {scale.long_prompt_median} tokens (up to {int(lengths.max())}), "
                   f"{scale.long_output} output tokens each, all at t=0, on {LONG_CONTEXT_MODEL} "
                   f"(5 sliding : 1 full); the pool holds {scale.long_pool_seqs} requests at full length "
                   "without hybrid KV groups")
    return Workload("long-context", requests, description, kv_budget_tokens=pool, model=LONG_CONTEXT_MODEL)


def build(name: str, scale: Scale, vocab: int, seed: int, rate: Optional[float] = None) -> Workload:
    """The workload ``name`` (one of ``SCENARIOS``); raises ``ValueError`` for unknown names."""
    if name == "sharegpt":
        return sharegpt(scale, vocab, seed, rate)
    if name == "burst":
        return burst(scale, vocab, seed)
    if name == "shared-prefix":
        return shared_prefix(scale, vocab, seed, rate)
    if name == "multi-turn":
        return multi_turn(scale, vocab, seed)
    if name == "long-context":
        return long_context(scale, vocab, seed)
    raise ValueError(f"unknown scenario {name!r}; choose from {', '.join(SCENARIOS)}")
