"""The synchronous engine: scheduler -> model runner -> sampler -> output processor, one step at a time.

``LLMEngine`` is written against ``kvpage.engine.interfaces`` only (a ``ModelRunner``, a
``Sampler`` and the optional ``KVTierAgent`` and ``KVEventPublisher``), so it imports no
tensor library; every collaborator arrives in the constructor (``kvpage.engine.builder``
assembles a Hugging Face engine). Ownership: the ``Scheduler`` owns each sequence's
scheduling state and tokens; the ``OutputProcessor`` owns everything the user sees. A fault
in one step fails only that step's requests (``finish_reason == "error"``); everything
else keeps running.

With lower KV tiers the engine drives ``kv_tiers`` through ``TierSteps``: each step it
reports finished disk reads and failed writes to the scheduler, runs the step's tier copies
before the forward, and after a successful step hands over the disk writes. With a
``kv_event_publisher`` each step's KV events go out as one batch. Every successful step's
size and wall time (tier copies, forward, sampling, output processing) go back to the
scheduler (``Scheduler.observe_step``), whose step-time budget (``max_step_ms``) learns from them.
"""
from __future__ import annotations

import itertools
import time
from typing import Any, Callable, Hashable, Optional, Sequence

from kvpage.core.request import FinishReason, Request, sample_request_id
from kvpage.core.sampling_params import SamplingParams
from kvpage.core.sched.output import SchedulerOutput
from kvpage.core.sched.scheduler import Scheduler
from kvpage.engine.interfaces import (KVEventPublisher, KVTierAgent, Logits, ModelRunner, SampleResult, Sampler,
                                      check_logits_shape)
from kvpage.engine.output_processor import OutputProcessor, OutputSink, sequence_ids
from kvpage.engine.outputs import RequestOutput, StreamDelta
from kvpage.engine.prompts import Prompt, PromptEncoder, with_eos_stops
from kvpage.engine.step_stats import StepStats
from kvpage.engine.step_timeline import StepTimeline, timeline_from_env
from kvpage.engine.tier_steps import TierSteps
from kvpage.platform.thread_governor import ThreadGovernor
from kvpage.platform.threads import set_compute_threads

#: Called with every non-empty step's ``SchedulerOutput`` before the model runs it.
StepObserver = Callable[[SchedulerOutput], None]


class LLMEngine:
    """One model's engine.

    ``kv_tiers``: the agent for the scheduler's lower KV tiers (required exactly when the
    scheduler has them). ``kv_event_publisher``: where each step's KV events go.
    ``compute_threads``: a CPU engine's configured thread count, and ``thread_governor`` the
    governor that lowers it while other processes keep the CPUs busy (None: fixed).
    """

    def __init__(self, runner: ModelRunner, sampler: Sampler, tokenizer: Any, scheduler: Scheduler,
                 vocab_size: int, eos_token_ids: Sequence[int] = (), *, kv_tiers: Optional[KVTierAgent] = None,
                 kv_event_publisher: Optional[KVEventPublisher] = None, compute_threads: Optional[int] = None,
                 thread_governor: Optional[ThreadGovernor] = None) -> None:
        if (kv_tiers is None) != (scheduler.tiers is None):
            raise ValueError("an engine needs a KV tier agent exactly when its scheduler has lower KV tiers")
        self.runner = runner
        self.sampler = sampler
        self.scheduler = scheduler
        self.prompts = PromptEncoder(tokenizer, vocab_size)
        self.outputs = OutputProcessor(tokenizer)
        self.eos_token_ids = tuple(eos_token_ids)
        self.step_stats = StepStats(scheduler)
        self.step_observers: list[StepObserver] = [self.step_stats.record]
        self.num_step_errors = 0
        self.num_prompt_tokens = 0  # tokens of accepted prompts
        self._ids = itertools.count()
        self.kv_tiers = kv_tiers
        self._tiers = TierSteps(kv_tiers, scheduler.tiers) if kv_tiers is not None else None
        self.kv_event_publisher = kv_event_publisher
        self.compute_threads = compute_threads
        self.thread_governor = thread_governor
        self.timeline: Optional[StepTimeline] = timeline_from_env()  # a diagnostic (step_timeline)

    def adopt_current_thread(self) -> None:
        """Call in a thread that is about to run ``step`` after another thread built or
        stepped the engine: gives this thread the engine's compute-thread count (numba keeps
        its count per thread). The thread handing over calls ``threads.release_thread_pools``."""
        if self.compute_threads is not None:
            set_compute_threads(self.thread_governor.current if self.thread_governor else self.compute_threads)

    @property
    def tokenizer(self) -> Any:
        return self.prompts.tokenizer

    @property
    def vocab_size(self) -> int:
        """Token ids a prompt may hold: ``[0, vocab_size)``."""
        return self.prompts.vocab_size

    @property
    def max_model_len(self) -> int:
        """Tokens a sequence may reach, prompt and output together."""
        return self.scheduler.config.max_model_len

    @property
    def block_size(self) -> int:
        """Tokens per KV block."""
        return self.scheduler.block_size

    def add_step_observer(self, observer: StepObserver) -> None:
        """Call ``observer`` with every non-empty step's ``SchedulerOutput`` before the model runs it."""
        self.step_observers.append(observer)

    # ------------------------------------------------------------------ intake and control
    def add_request(self, prompt: Prompt, params: Optional[SamplingParams] = None, request_id: Optional[str] = None,
                    namespace: Hashable = None, sink: Optional[OutputSink] = None) -> str:
        """Validate and queue a request; returns its id. Raises ``ValueError`` on bad input.

        With ``sink``, every delta and then the final output go to it; otherwise the final
        output waits in ``take_finished``.
        """
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        request_id = self._new_id() if request_id is None else str(request_id)
        if request_id in self.outputs.states:
            raise ValueError(f"request id {request_id!r} is already in use")
        if "#" in request_id:
            raise ValueError(f"request id {request_id!r}: '#' is reserved for naming parallel samples")
        token_ids = self.prompts.encode(prompt)
        self.prompts.check_params(params)
        eos = self.eos_token_ids[0] if self.eos_token_ids else None
        request = Request(sample_request_id(request_id, 0, params.n), token_ids,
                          with_eos_stops(params, self.eos_token_ids), eos, namespace, group_id=request_id)
        self.scheduler.add_request(request)  # raises before any engine state is touched
        self.outputs.add_request(request_id, prompt if isinstance(prompt, str) else None, params, request, sink)
        self.num_prompt_tokens += len(token_ids)
        return request_id

    def _new_id(self) -> str:
        while (request_id := str(next(self._ids))) in self.outputs.states:
            pass  # the caller chose this one earlier
        return request_id

    def abort(self, request_id: str) -> bool:
        """Abort a live request, freeing its blocks; returns False if it is not live."""
        return self.abort_with_output(request_id) is not None

    def abort_with_output(self, request_id: str, deliver: bool = True,
                          reason: FinishReason = FinishReason.ABORT) -> Optional[RequestOutput]:
        """``abort``, returning the request's output so far (its unfinished samples end with
        ``reason``, "abort" unless told, e.g. "length" for a deadline; a sink receives it too
        unless ``deliver`` is False)."""
        state = self.outputs.states.get(request_id)
        if state is None:
            return None
        self.scheduler.finish_requests(sequence_ids(state), reason)
        return self.outputs.abort(request_id, deliver)

    def abort_all(self) -> list[Optional[OutputSink]]:
        """Abort every live request without delivering anything; returns their sinks."""
        sinks = [state.sink for state in self.outputs.states.values()]
        for request_id in list(self.outputs.states):
            self.abort_with_output(request_id, deliver=False)
        return sinks

    def has_request(self, request_id: str) -> bool:
        return request_id in self.outputs.states

    def sink_of(self, request_id: str) -> Optional[OutputSink]:
        """The sink of live request ``request_id`` (None when it has none or is not live)."""
        state = self.outputs.states.get(request_id)
        return None if state is None else state.sink

    def has_unfinished_requests(self) -> bool:
        return bool(self.outputs.states)

    def take_finished(self) -> dict[str, RequestOutput]:
        """Final outputs of the (sink-less) requests that ended since the last call."""
        return self.outputs.take_finished()

    # ------------------------------------------------------------------ the step
    def step(self) -> list[StreamDelta]:
        """Run one scheduled step; return a delta for every sample that changed."""
        if self.thread_governor is not None:
            self.thread_governor.tick()  # in the thread that runs the forward: the counts are per thread
        timeline = self.timeline
        begin = timeline.mark() if timeline is not None else None
        if self._tiers is not None:
            self._tiers.report_results()
        output = self.scheduler.schedule()
        if output.is_empty:
            if self._tiers is not None:
                self._tiers.idle(output)  # disk reads for parked requests
            deltas: list[StreamDelta] = []
        else:
            scheduled = timeline.mark() if timeline is not None else None
            started = time.perf_counter()
            logits, deltas = self._execute(output)
            forwarded = timeline.mark() if timeline is not None else None
            if logits is not None:
                deltas = self._postprocess(output, logits)
                # The step-time budget learns this machine's cost per token from successful steps.
                self.scheduler.observe_step(output.metadata.num_tokens, output.metadata.num_seqs,
                                            time.perf_counter() - started)
            if timeline is not None:
                timeline.record(begin, scheduled, forwarded, timeline.mark(), output.metadata.num_seqs,
                                output.metadata.num_tokens)
        self._publish_kv_events()
        return deltas

    def _execute(self, output: SchedulerOutput) -> tuple[Optional[Logits], list[StreamDelta]]:
        """The step's tier copies and forward: (logits, []), or (None, the deltas of the
        requests it failed) when either raised or the runner returned the wrong shape."""
        for observe in self.step_observers:
            observe(output)
        copied = False
        try:
            if self._tiers is not None:
                self._tiers.copy_in(output)
            copied = True
            logits = self.runner.execute(output.metadata)
            problem = check_logits_shape(logits, len(output.metadata.logits_indices))
            if problem:
                raise RuntimeError(problem)
        except Exception as exc:  # noqa: BLE001 - a failed step must not take the engine down
            self.num_step_errors += 1
            deltas = self._fail(output.requests, f"model step failed: {type(exc).__name__}: {exc}")
            self.scheduler.discard_step_cache(output)  # its KV was never (fully) written
            if not copied and self._tiers is not None:
                self._tiers.discard(output)
            self.outputs.close_finished()
            return None, deltas
        return logits, []

    def _postprocess(self, output: SchedulerOutput, logits: Logits) -> list[StreamDelta]:
        """Sample, advance the scheduler and turn the new tokens into deltas."""
        rows = output.sampled_requests
        result, errors = self._sample(logits[: len(rows)], rows)  # sampled rows first, then prompt rows
        if output.metadata.num_prompt_logits_rows:
            self._prompt_logprobs(output, logits[len(rows):])
        deltas = []
        for row, message in errors.items():
            deltas += self._fail([rows[row]], message)
        if result.invalid_rows:
            self.scheduler.discard_step_cache(output)  # the step wrote non-finite KV
        self.scheduler.update_from_output(output, result.token_ids, result.forks and
                                          {row: fork.token_ids for row, fork in result.forks.items()})
        deltas += self.outputs.process_step(output, result, set(errors))
        self.scheduler.finish_requests(self.outputs.take_stopped(), FinishReason.STOP)  # all stop strings at once
        self.outputs.close_finished()
        if self._tiers is not None:
            self._tiers.save(output)  # before the next schedule can reuse the blocks: the agent snapshots them now
        return deltas

    def _publish_kv_events(self) -> None:
        events = self.scheduler.take_kv_events()
        if events and self.kv_event_publisher is not None:
            self.kv_event_publisher.publish(events)

    def reset_prefix_cache(self) -> None:
        """Empty every KV tier (pool cache, host, disk files). Raises ``ValueError`` while
        any cached block is in use."""
        dropped = self.scheduler.reset_prefix_cache()
        if self._tiers is not None:
            self._tiers.clear(dropped)
        self._publish_kv_events()

    def flush_kv_tiers(self, timeout_s: float = 30.0) -> bool:
        """Wait up to ``timeout_s`` seconds for the disk tier's queued reads and writes; True
        when they all finished (also without tiers)."""
        return self.kv_tiers.flush(timeout_s) if self.kv_tiers is not None else True

    def close(self) -> None:
        """Finish the disk tier's queued writes and stop the background threads (idempotent);
        write the step timeline when one is recorded."""
        if self.timeline is not None:
            self.timeline.dump()
        if self.kv_tiers is not None:
            self.kv_tiers.close()
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.close()

    def _sample(self, logits: Logits, rows: list[Request]) -> tuple[SampleResult, dict[int, str]]:
        """Sample every row; returns (result, {row: why it failed}). If the sampler raises,
        rows are retried one by one so that only the rows it cannot draw fail."""
        try:
            result = self.sampler.sample(logits, rows)
        except Exception:  # noqa: BLE001 - one bad row must not fail the whole batch
            parts, errors = {}, {}
            for j, request in enumerate(rows):
                try:
                    parts[j] = self.sampler.sample(logits[j : j + 1], [request])
                except Exception as exc:  # noqa: BLE001
                    errors[j] = f"sampling failed: {type(exc).__name__}: {exc}"
            result = SampleResult.merge(parts, len(rows))
        else:
            errors = {}
        errors.update({j: "the model produced non-finite logits" for j in result.invalid_rows})
        return result, errors

    def _prompt_logprobs(self, output: SchedulerOutput, logits: Logits) -> None:
        """Log-probabilities of the prompt tokens this step computed, for requests that ask."""
        requests, metadata = output.prompt_logits_requests, output.metadata
        entries = self.sampler.prompt_logprobs(logits, metadata.prompt_logits_token_ids,
                                               [r.sampling_params.prompt_logprobs for r in requests])
        self.outputs.add_prompt_logprobs(requests, metadata.prompt_logits_positions.tolist(), entries)

    def _fail(self, requests: Sequence[Request], message: str) -> list[StreamDelta]:
        live = self.scheduler.finish_requests([r.request_id for r in requests], FinishReason.ERROR, message)
        return self.outputs.fail(live, message)

    # ------------------------------------------------------------------ observability
    def cached_block_hashes(self, max_blocks: Optional[int] = None) -> list[int]:
        """Chained hashes of the blocks in the prefix cache (``RadixCache.block_hashes``);
        empty without prefix caching."""
        cache = self.scheduler.prefix_cache
        return [] if cache is None else cache.block_hashes(max_blocks=max_blocks)

    @property
    def kv_fragmentation(self) -> float:
        """Fraction of token slots in the pool's referenced blocks that hold no token, in [0, 1]."""
        return self.scheduler.pool.fragmentation

    def check_integrity(self) -> None:
        """Assert the scheduler's block accounting balances (tests, census runs)."""
        self.scheduler.check_integrity()

    def reset_step_stats(self) -> None:
        """Forget the step timings so far (after a warm-up)."""
        self.step_stats.reset()

    def stats(self) -> dict:
        stats = self.scheduler.stats()
        stats["num_step_errors"] = self.num_step_errors
        stats["prompt_tokens"] = self.num_prompt_tokens
        stats["generation_tokens"] = self.outputs.num_generation_tokens
        kv_cache = getattr(self.runner, "kv_cache", None)  # a test's fake runner may have none
        if kv_cache is not None:
            stats["kv_cache_dtype"] = kv_cache.spec.kv_format.name
            stats["kv_bytes_per_token"] = kv_cache.spec.bytes_per_token
        stats.update(self.step_stats.summary())
        graphs = getattr(self.runner, "decode_graphs", None)
        if graphs is not None:
            stats["decode_graph_steps"] = graphs.replayed_steps
        if self.thread_governor is not None:
            stats["compute_threads"] = self.thread_governor.current
        if self.kv_tiers is not None:
            stats.update(self.kv_tiers.stats())
        if self.kv_event_publisher is not None:
            stats["kv_events_published"] = self.kv_event_publisher.num_published
            stats["kv_events_dropped"] = self.kv_event_publisher.num_dropped
        return stats
