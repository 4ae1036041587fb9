"""The synchronous engine: scheduler -> model runner -> sampler -> output processor, one step at a time.

``LLMEngine`` is written against ``kvpage.engine.interfaces`` only (a ``ModelRunner`` and a
``Sampler``), so it imports no tensor library. Ownership: the ``Scheduler`` owns each
sequence's scheduling state and tokens; the ``OutputProcessor`` owns everything the user
sees. A fault in one step fails only that step's requests (``finish_reason == "error"``);
everything else keeps running.

With lower KV tiers the engine also drives ``kv_tiers`` (``kvpage.storage.tiers.KVTierAgent``):
each step it reports finished disk reads and failed writes to the scheduler, runs the
step's tier copies before the forward, and after a successful step hands over the disk
writes. With a ``kv_event_publisher`` each step's KV events go out as one batch.
"""
from __future__ import annotations

import itertools
from typing import Any, Callable, Hashable, Optional, Sequence

from kvpage.core.request import FinishReason, Request, sample_request_id
from kvpage.core.sampling_params import SamplingParams
from kvpage.core.sched.output import SchedulerOutput
from kvpage.core.sched.scheduler import Scheduler
from kvpage.engine.interfaces import ModelRunner, SampleResult, Sampler, check_logits_shape
from kvpage.engine.output_processor import OutputProcessor, OutputSink, sequence_ids
from kvpage.engine.outputs import RequestOutput, StreamDelta
from kvpage.engine.prompts import Prompt, PromptEncoder, with_eos_stops
from kvpage.engine.step_stats import StepStats

#: Called with every non-empty step's ``SchedulerOutput`` before the model runs it.
StepObserver = Callable[[SchedulerOutput], None]


class LLMEngine:
    def __init__(self, runner: ModelRunner, sampler: Sampler, tokenizer: Any, scheduler: Scheduler,
                 vocab_size: int, eos_token_ids: Sequence[int] = ()) -> None:
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
        self.kv_tiers: Optional[Any] = None  # a KVTierAgent, attached by kvpage.storage.tiers.attach_kv_tiers
        self.kv_event_publisher: Optional[Any] = None  # attached by kv_events_publisher.attach_kv_events
        self.thread_governor: Optional[Any] = None  # a thread_governor.ThreadGovernor, set by the builder
        self.compute_threads: Optional[int] = None  # CPU runners: the count the builder configured

    def adopt_current_thread(self) -> None:
        """Call in a thread that is about to run ``step`` after another thread built or
        stepped the engine: gives this thread the engine's compute-thread count (numba keeps
        its count per thread). The thread handing over calls ``threads.release_thread_pools``."""
        if self.compute_threads is not None:
            from kvpage.platform.threads import set_compute_threads

            set_compute_threads(self.thread_governor.current if self.thread_governor else self.compute_threads)

    @property
    def tokenizer(self) -> Any:
        return self.prompts.tokenizer

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
        self._report_tier_results()
        output = self.scheduler.schedule()
        if output.is_empty:
            if self.kv_tiers is not None:
                try:
                    self.kv_tiers.before_step(output.kv_transfers)  # disk reads for parked requests
                except Exception:  # noqa: BLE001 - no request read these copies: forget them
                    self.scheduler.tiers.discard_transfers(output)
                if self.scheduler.fetch_waits:
                    self.kv_tiers.wait(0.05)  # only disk reads can make progress: do not spin
            self._publish_kv_events()
            return []
        for observe in self.step_observers:
            observe(output)
        copied = False
        try:
            if self.kv_tiers is not None:
                self.kv_tiers.before_step(output.kv_transfers)
            copied = True
            logits = self.runner.execute(output.metadata)
            problem = check_logits_shape(logits, len(output.metadata.logits_indices))
            if problem:
                raise RuntimeError(problem)
        except Exception as exc:  # noqa: BLE001 - a failed step must not take the engine down
            self.num_step_errors += 1
            deltas = self._fail(output.requests, f"model step failed: {type(exc).__name__}: {exc}")
            self.scheduler.discard_step_cache(output)  # its KV was never (fully) written
            if not copied:
                self.scheduler.tiers.discard_transfers(output)
            self.outputs.close_finished()
            self._publish_kv_events()
            return deltas
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
        if self.kv_tiers is not None:
            # Before the next schedule can reuse the blocks: the agent snapshots them now.
            self.kv_tiers.save(self.scheduler.tiers.take_saves(output))
        self._publish_kv_events()
        return deltas

    def _report_tier_results(self) -> None:
        if self.kv_tiers is None:
            return
        fetched, failed_saves = self.kv_tiers.poll()
        self.scheduler.tiers.complete_saves(failed_saves)
        self.scheduler.tiers.complete_fetches(fetched)  # also times out requests waiting too long

    def _publish_kv_events(self) -> None:
        events = self.scheduler.take_kv_events()
        if events and self.kv_event_publisher is not None:
            self.kv_event_publisher.publish(events)

    def reset_prefix_cache(self) -> None:
        """Empty every KV tier (pool cache, host, disk files). Raises ``ValueError`` while
        any cached block is in use."""
        dropped = self.scheduler.reset_prefix_cache()
        if self.kv_tiers is not None:
            self.kv_tiers.clear_disk(dropped)
        self._publish_kv_events()

    def close(self) -> None:
        """Finish the disk tier's queued writes and stop the background threads (idempotent)."""
        if self.kv_tiers is not None:
            self.kv_tiers.close()
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.close()

    def _sample(self, logits: Any, rows: list[Request]) -> tuple[SampleResult, dict[int, str]]:
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

    def _prompt_logprobs(self, output: SchedulerOutput, logits: Any) -> None:
        """Log-probabilities of the prompt tokens this step computed, for requests that ask."""
        requests, metadata = output.prompt_logits_requests, output.metadata
        entries = self.sampler.prompt_logprobs(logits, metadata.prompt_logits_token_ids,
                                               [r.sampling_params.prompt_logprobs for r in requests])
        self.outputs.add_prompt_logprobs(requests, metadata.prompt_logits_positions.tolist(), entries)

    def _fail(self, requests: Sequence[Request], message: str) -> list[StreamDelta]:
        live = self.scheduler.finish_requests([r.request_id for r in requests], FinishReason.ERROR, message)
        return self.outputs.fail(live, message)

    # ------------------------------------------------------------------ observability
    def stats(self) -> dict:
        stats = self.scheduler.stats()
        stats["num_step_errors"] = self.num_step_errors
        stats["prompt_tokens"] = self.num_prompt_tokens
        stats["generation_tokens"] = self.outputs.num_generation_tokens
        stats.update(self.step_stats.summary())
        if self.thread_governor is not None:
            stats["compute_threads"] = self.thread_governor.current
        if self.kv_tiers is not None:
            stats.update(self.kv_tiers.stats())
        if self.kv_event_publisher is not None:
            stats["kv_events_published"] = self.kv_event_publisher.num_published
            stats["kv_events_dropped"] = self.kv_event_publisher.num_dropped
        return stats
