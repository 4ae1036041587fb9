"""Output processing: everything a user sees of a request, owned in one place.

One ``RequestState`` per user request holds what only the user side needs for its ``n``
samples: the incremental detokenizer and stop strings, the log-probabilities, and where
results go (a sink callback, or the engine's finished list). Tokens, timestamps, cached
token counts and finish reasons are *read* from the scheduler's ``Request`` objects, which
own them; nothing here copies them.

The engine drives it once per step: ``process_step`` turns the step's new tokens into
``StreamDelta``s and reports which sequences a stop string ended (``take_stopped``); once
the engine has finished those in the scheduler, ``close_finished`` closes the requests
whose samples have all ended. Torch-free.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from kvpage.core.request import FinishReason, Request
from kvpage.core.sampling_params import SamplingParams
from kvpage.core.sched.output import SchedulerOutput
from kvpage.engine.detokenizer import IncrementalDetokenizer
from kvpage.engine.interfaces import SampleResult
from kvpage.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, StreamDelta

#: Receives each ``StreamDelta`` of a request, then its final ``RequestOutput``.
OutputSink = Callable[[object], None]


@dataclass(slots=True)
class SampleState:
    """The user-side state of one sample; ``request`` is the scheduler's sequence."""

    request: Request
    detokenizer: Optional[IncrementalDetokenizer]
    logprobs: Optional[list]
    cumulative_logprob: float = 0.0

    @property
    def finish_reason(self) -> Optional[str]:
        """The scheduler's reason, except that a stop string found in the text is a stop even
        when the same token also reached the length limit."""
        detokenizer, reason = self.detokenizer, self.request.finish_reason
        if detokenizer is not None and detokenizer.stopped_by is not None and reason is not FinishReason.ERROR:
            return FinishReason.STOP.value
        return reason.value if reason is not None else None

    def output(self, index: int) -> CompletionOutput:
        request = self.request
        reason = self.finish_reason
        return CompletionOutput(index, self.detokenizer.text if self.detokenizer else "", request.output_token_ids,
                                reason, self.logprobs, self.cumulative_logprob if self.logprobs is not None else None,
                                request.error)


@dataclass(slots=True)
class RequestState:
    """One user request: its prompt, parameters and samples (``samples[k]`` is sample ``k``).

    Samples 1..n-1 are forked at the first token; ``unforked_reason`` (and ``error``) is set
    when the request ended (failed or aborted) before they existed, and stands for them in
    the output.
    """

    request_id: str
    prompt: Optional[str]
    params: SamplingParams
    samples: list[SampleState]
    sink: Optional[OutputSink] = None
    error: Optional[str] = None
    unforked_reason: Optional[FinishReason] = None
    finished_time: Optional[float] = None
    prompt_logprobs: Optional[list] = None  # one PromptTokenLogprob (or None) per prompt position

    @property
    def finished(self) -> bool:
        complete = len(self.samples) == self.params.n or self.unforked_reason is not None
        return complete and all(s.request.is_finished for s in self.samples)

    def metrics(self) -> RequestMetrics:
        requests = [s.request for s in self.samples]
        first = [r.first_token_time for r in requests if r.first_token_time is not None]
        last = [r.last_token_time for r in requests if r.last_token_time is not None]
        return RequestMetrics(requests[0].arrival_time, min(first, default=None), max(last, default=None),
                              self.finished_time, requests[0].num_cached_tokens,
                              max(r.num_preemptions for r in requests))

    def output(self) -> RequestOutput:
        outputs = [s.output(i) for i, s in enumerate(self.samples)]
        reason = self.unforked_reason.value if self.unforked_reason is not None else None
        outputs += [CompletionOutput(k, "", [], reason, error=self.error)
                    for k in range(len(self.samples), self.params.n)]
        return RequestOutput(self.request_id, self.prompt, self.samples[0].request.prompt_token_ids, outputs,
                             self.finished, self.metrics(),
                             None if self.prompt_logprobs is None else list(self.prompt_logprobs))


class OutputProcessor:
    """The live ``RequestState``s, keyed by user request id (the only such map)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}
        self.num_generation_tokens = 0  # tokens emitted to users
        self._finished: dict[str, RequestOutput] = {}
        self._stopped: list[str] = []  # sequences a stop string ended this step
        self._closing: list[RequestState] = []  # states that may have finished this step

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt: Optional[str], params: SamplingParams, first: Request,
                    sink: Optional[OutputSink] = None) -> None:
        state = RequestState(request_id, prompt, params, [self._new_sample(first, params)], sink)
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None] * first.num_prompt_tokens
        self.states[request_id] = state

    def add_prompt_logprobs(self, requests: Sequence[Request], positions: Sequence[int], entries: Sequence) -> None:
        """Record ``entries[r]``, the log-probability of prompt position ``positions[r]`` of
        ``requests[r]``. Positions are slots, so a prompt recomputed after preemption
        overwrites rather than appends."""
        for request, position, entry in zip(requests, positions, entries):
            state = self.state_of(request)
            if state is not None and state.prompt_logprobs is not None:
                state.prompt_logprobs[position] = entry

    def _new_sample(self, request: Request, params: SamplingParams) -> SampleState:
        detokenizer = None
        if self.tokenizer is not None:
            detokenizer = IncrementalDetokenizer(self.tokenizer, request.num_prompt_tokens, params.stop)
        return SampleState(request, detokenizer, [] if params.logprobs is not None else None)

    def state_of(self, request: Request) -> Optional[RequestState]:
        return self.states.get(request.group_id)

    # ------------------------------------------------------------------ the step
    def process_step(self, output: SchedulerOutput, result: SampleResult, skip_rows: set) -> list[StreamDelta]:
        """Deltas for the tokens the scheduler appended this step (rows in ``skip_rows`` failed)."""
        deltas: list[StreamDelta] = []
        for row, request in enumerate(output.sampled_requests):
            state = self.state_of(request)
            if state is None or row in skip_rows:
                continue
            children = output.forked.get(row, ())
            state.samples += [self._new_sample(child, state.params) for child in children]
            deltas.append(self._emit(state, request, result.logprobs[row], float(result.token_logprobs[row])))
            if children:
                forks = result.forks[row]
                deltas += [self._emit(state, child, forks.logprobs[k], float(forks.token_logprobs[k]))
                           for k, child in enumerate(children)]
        return deltas

    def _emit(self, state: RequestState, request: Request, logprobs: Optional[dict], token_logprob: float) -> StreamDelta:
        sample = state.samples[request.sample_index]
        token = request.all_token_ids[-1]
        self.num_generation_tokens += 1
        sample.cumulative_logprob += token_logprob
        if sample.logprobs is not None:
            sample.logprobs.append(logprobs)
        detokenizer = sample.detokenizer
        text = detokenizer.update(request.all_token_ids) if detokenizer else ""
        reason = sample.finish_reason
        if reason is not None and not request.is_finished:  # a stop string: the engine finishes it
            self._stopped.append(request.request_id)
        if reason is not None:
            text += detokenizer.flush(request.all_token_ids) if detokenizer else ""
            self._closing.append(state)
        return self._deliver(state, StreamDelta(state.request_id, request.sample_index, text, [token], reason,
                                                [logprobs] if logprobs is not None else None))

    def take_stopped(self) -> list[str]:
        """Ids of sequences that a stop string ended this step (to finish in the scheduler)."""
        stopped, self._stopped = self._stopped, []
        return stopped

    def fail(self, requests: Sequence[Request], message: str) -> list[StreamDelta]:
        """Deltas for sequences that failed (already finished with ``ERROR`` in the scheduler).

        A request failing before its first token never forks its other samples: they fail too.
        """
        deltas = []
        for request in requests:
            state = self.state_of(request)
            if state is None:
                continue
            deltas.append(self._deliver(state, StreamDelta(state.request_id, request.sample_index, "", [],
                                                           FinishReason.ERROR.value, None, message)))
            if len(state.samples) < state.params.n and state.unforked_reason is None:
                state.unforked_reason, state.error = FinishReason.ERROR, message
                deltas += [self._deliver(state, StreamDelta(state.request_id, k, "", [], FinishReason.ERROR.value,
                                                            None, message))
                           for k in range(len(state.samples), state.params.n)]
            self._closing.append(state)
        return deltas

    def close_finished(self) -> None:
        """Close the requests whose samples have all ended: deliver or keep their outputs."""
        closing, self._closing = self._closing, []
        for state in closing:
            if state.finished and self.states.get(state.request_id) is state:
                self._close(state, deliver=True)

    def _close(self, state: RequestState, deliver: bool) -> RequestOutput:
        del self.states[state.request_id]
        state.finished_time = time.monotonic()
        output = state.output()
        if deliver and state.sink is not None:
            state.sink(output)
        elif deliver:
            self._finished[state.request_id] = output
        return output

    def _deliver(self, state: RequestState, delta: StreamDelta) -> StreamDelta:
        if state.sink is not None:
            state.sink(delta)
        return delta

    # ------------------------------------------------------------------ endings
    def abort(self, request_id: str, deliver: bool = True) -> Optional[RequestOutput]:
        """Close a request whose sequences the scheduler has aborted; returns its output, which
        also goes to the request's sink if ``deliver`` (never to ``take_finished``)."""
        state = self.states.get(request_id)
        if state is None:
            return None
        if len(state.samples) < state.params.n and state.unforked_reason is None:
            state.unforked_reason = FinishReason.ABORT
        output = self._close(state, deliver=False)
        if deliver and state.sink is not None:
            state.sink(output)
        return output

    def take_finished(self) -> dict[str, RequestOutput]:
        """Final outputs of sink-less requests that ended since the last call."""
        done, self._finished = self._finished, {}
        return done


def sequence_ids(state: RequestState) -> list[str]:
    """Scheduler ids of a request's sequences."""
    return [s.request.request_id for s in state.samples]
