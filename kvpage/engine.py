"""The synchronous engine: scheduler -> model runner -> sampler -> detokenizer, one step at a time.

``LLMEngine`` is framework-light: it needs a *runner* with ``execute(StepMetadata) ->
logits [S, V]`` and a tokenizer. A fault in one step fails only that step's requests
(``finish_reason == "error"``); everything else keeps running.
"""
from __future__ import annotations

import dataclasses
import itertools
import operator
import time
from dataclasses import dataclass, field
from typing import Any, Hashable, Optional, Sequence, Union

import numpy as np

from .config import CacheConfig, SchedulerConfig
from .detokenizer import IncrementalDetokenizer
from .outputs import CompletionOutput, RequestMetrics, RequestOutput, StreamDelta
from .request import FinishReason, Request
from .sampling_params import SamplingParams
from .scheduler import Scheduler, SchedulerOutput

Prompt = Union[str, Sequence[int]]


@dataclass
class _Sample:
    """One of a request's ``n`` samples: its scheduler request and its text state."""

    seq_id: str
    detokenizer: IncrementalDetokenizer
    logprobs: Optional[list] = None
    cumulative_logprob: float = 0.0
    finish_reason: Optional[str] = None
    error: Optional[str] = None
    token_ids: list = field(default_factory=list)


@dataclass
class _Group:
    """A user request: the prompt, its parameters and its ``n`` samples."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list
    params: SamplingParams
    metrics: RequestMetrics
    samples: list = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return len(self.samples) == self.params.n and all(s.finish_reason for s in self.samples)


class LLMEngine:
    def __init__(self, runner: Any, sampler: Any, tokenizer: Any, cache_config: CacheConfig,
                 scheduler_config: SchedulerConfig, vocab_size: int, eos_token_ids: Sequence[int] = ()) -> None:
        self.runner = runner
        self.sampler = sampler
        self.tokenizer = tokenizer
        self.scheduler = Scheduler(cache_config, scheduler_config)
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self._groups: dict[str, _Group] = {}
        self._seq_owner: dict[str, tuple[_Group, int]] = {}
        self._ids = itertools.count()
        self.num_step_errors = 0
        self._finished_outputs: dict[str, _Group] = {}
        self.step_stats = _StepStats()
        self.num_prompt_tokens = 0  # tokens of accepted prompts
        self.num_generation_tokens = 0  # tokens sampled for live requests

    # ------------------------------------------------------------------ intake
    def tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty")
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; pass token ids instead")
            ids = list(self.tokenizer.encode(prompt))
            if not ids:
                raise ValueError("the prompt encodes to no tokens")
        else:
            try:  # operator.index: ints (numpy and 0-d tensors too), never floats, strings or None
                ids = [operator.index(t) for t in prompt]
            except TypeError:
                raise ValueError("a prompt must be a string or a sequence of integer token ids") from None
        if not ids:
            raise ValueError("the prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        return ids

    def add_request(self, prompt: Prompt, params: Optional[SamplingParams] = None,
                    request_id: Optional[str] = None, namespace: Hashable = None) -> str:
        """Validate and queue a request; returns its id. Raises ``ValueError`` on bad input."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        token_ids = self.tokenize(prompt)
        eos = self.eos_token_ids[0] if self.eos_token_ids else None
        params_for_seq = params
        if len(self.eos_token_ids) > 1 and not params.ignore_eos:
            extra = tuple(t for t in self.eos_token_ids[1:] if t not in params.stop_token_ids)
            params_for_seq = _with_stop_ids(params, extra)
        seq_id = request_id if params.n == 1 else f"{request_id}#0"
        request = Request(seq_id, token_ids, params_for_seq, eos, namespace)
        self.scheduler.add_request(request)  # raises before any engine state is touched
        group = _Group(request_id, prompt if isinstance(prompt, str) else None, token_ids, params,
                       RequestMetrics(arrival_time=request.arrival_time))
        self._add_sample(group, seq_id)
        self._groups[request_id] = group
        self.num_prompt_tokens += len(token_ids)
        return request_id

    def _add_sample(self, group: _Group, seq_id: str) -> _Sample:
        sample = _Sample(seq_id, IncrementalDetokenizer(self.tokenizer, group.prompt_token_ids, group.params.stop)
                         if self.tokenizer is not None else None)
        if group.params.logprobs is not None:
            sample.logprobs = []
        self._seq_owner[seq_id] = (group, len(group.samples))
        group.samples.append(sample)
        return sample

    # ------------------------------------------------------------------ control
    def abort(self, request_id: str) -> bool:
        """Abort a live request, freeing its blocks; returns False if it is not live."""
        return self.abort_with_output(request_id) is not None

    def abort_with_output(self, request_id: str) -> Optional[RequestOutput]:
        """``abort``, returning the request's output so far (its unfinished samples end with
        ``finish_reason == "abort"``), or None if it is not live."""
        group = self._groups.pop(request_id, None)
        if group is None:
            return None
        for sample in group.samples:
            self.scheduler.abort(sample.seq_id)
            self._release(sample.seq_id)
            if sample.finish_reason is None:
                sample.finish_reason = FinishReason.ABORT.value
        return self.to_output(group)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._groups

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    def _release(self, seq_id: str) -> None:
        self._seq_owner.pop(seq_id, None)
        self.sampler.release(seq_id)

    # ------------------------------------------------------------------ the step
    def step(self) -> list[StreamDelta]:
        """Run one scheduled step; return a delta for every sample that changed."""
        output = self.scheduler.schedule()
        if output.is_empty:
            return []
        self.step_stats.record(self.scheduler)
        try:
            logits = self.runner.execute(output.metadata)
            _check_logits_shape(logits, len(output.metadata.sample_seq_indices))
        except Exception as exc:  # noqa: BLE001 - a failed step must not take the engine down
            self.num_step_errors += 1
            deltas = self._fail(output.requests, f"model step failed: {type(exc).__name__}: {exc}")
            self.scheduler.discard_step_cache(output)  # its KV was never (fully) written
            return deltas
        return self._process(output, logits)

    def _process(self, output: SchedulerOutput, logits: Any) -> list[StreamDelta]:
        import torch

        rows = [output.requests[i] for i in output.metadata.sample_seq_indices.tolist()]
        # A row is unusable with a NaN or +inf anywhere, or nothing above -inf (models may
        # mask part of the vocabulary with -inf, which is fine).
        ok = (~(torch.isnan(logits) | torch.isposinf(logits)).any(dim=-1)
              & (logits > float("-inf")).any(dim=-1)).tolist()
        deltas = self._fail([r for r, good in zip(rows, ok) if not good], "the model produced non-finite logits")
        if not all(ok):
            self.scheduler.discard_step_cache(output)
        if not all(ok):
            logits = torch.nan_to_num(logits)  # the failed rows are sampled, then ignored
        result, errors = self._sample_isolated(logits, rows)
        for j, message in errors.items():
            deltas += self._fail([rows[j]], message)
            ok[j] = False
        forks = self._plan_forks(rows, ok, logits, deltas)
        self.scheduler.update_from_output(output, result.token_ids, {j: pairs for j, (_, pairs) in forks.items()})
        for j, request in enumerate(rows):
            owner = self._seq_owner.get(request.request_id)
            if not ok[j] or owner is None:
                continue
            child_result, pairs = forks.get(j, (None, ()))
            for child, _ in pairs:  # registered first, so the group stays open until all n end
                self._add_sample(owner[0], child.request_id)
            deltas.append(self._emit(request, int(result.token_ids[j]), result.logprobs[j],
                                     float(result.token_logprobs[j])))
            for k, (child, token) in enumerate(pairs):
                deltas.append(self._emit(child, int(token), child_result.logprobs[k],
                                         float(child_result.token_logprobs[k])))
        return [d for d in deltas if d is not None]

    def _sample_isolated(self, logits: Any, rows: list[Request]) -> tuple[Any, dict[int, str]]:
        """Sample every row. If the sampler raises, retry row by row so that only the rows it
        cannot sample (e.g. parameters that overflow) fail; returns (result, {row: message})."""
        try:
            return self.sampler.sample(logits, rows), {}
        except Exception:  # noqa: BLE001 - one bad row must not fail the whole batch
            pass
        from .sampler import SampleResult

        tokens, token_logprobs = np.zeros(len(rows), dtype=np.int64), np.zeros(len(rows))
        logprobs: list = [None] * len(rows)
        errors: dict[int, str] = {}
        for j, request in enumerate(rows):
            try:
                one = self.sampler.sample(logits[j : j + 1], [request])
            except Exception as exc:  # noqa: BLE001
                errors[j] = _sampling_error(exc)
                continue
            tokens[j], logprobs[j], token_logprobs[j] = one.token_ids[0], one.logprobs[0], one.token_logprobs[0]
        return SampleResult(tokens, logprobs, token_logprobs), errors

    def _plan_forks(self, rows: list[Request], ok: list[bool], logits: Any, deltas: list) -> dict:
        """Parallel samples: at a group's first token, draw the other ``n - 1`` samples'
        first tokens from the same logits row; the scheduler forks them off that row.
        A group whose samples cannot be drawn fails (its deltas go to ``deltas``)."""
        forks: dict = {}
        for j, request in enumerate(rows):
            owner = self._seq_owner.get(request.request_id)
            if owner is None or not ok[j] or request.num_output_tokens:
                continue
            group = owner[0]
            n = group.params.n
            if n == 1 or len(group.samples) > 1:
                continue
            children = [Request(f"{group.request_id}#{k}", group.prompt_token_ids, _child_params(request.sampling_params, k),
                                request.eos_token_id, request.namespace) for k in range(1, n)]
            try:
                result = self.sampler.sample(logits[j : j + 1].expand(n - 1, -1), children)
            except Exception as exc:  # noqa: BLE001
                deltas.extend(self._fail([request], _sampling_error(exc)))
                ok[j] = False
                continue
            forks[j] = (result, list(zip(children, result.token_ids.tolist())))
        return forks

    def _emit(self, request: Request, token: int, logprobs: Optional[dict], token_logprob: float) -> Optional[StreamDelta]:
        group, index = self._seq_owner[request.request_id]
        sample = group.samples[index]
        sample.token_ids.append(token)
        self.num_generation_tokens += 1
        sample.cumulative_logprob += token_logprob
        if sample.logprobs is not None:
            sample.logprobs.append(logprobs)
        if group.metrics.first_token_time is None:
            group.metrics.first_token_time = request.first_token_time
            group.metrics.num_cached_tokens = request.num_cached_tokens
        group.metrics.last_token_time = request.last_token_time
        group.metrics.num_preemptions = max(group.metrics.num_preemptions, request.num_preemptions)
        text = sample.detokenizer.add_tokens([token]) if sample.detokenizer else ""
        if sample.detokenizer is not None and sample.detokenizer.stopped_by is not None and not request.is_finished:
            self.scheduler.finish_request(request.request_id, FinishReason.STOP)
        if request.is_finished:
            if sample.detokenizer is not None:
                text += sample.detokenizer.flush()
            sample.finish_reason = request.finish_reason.value
            self._release(request.request_id)
            self._maybe_close(group)
        return StreamDelta(group.request_id, index, text, [token], sample.finish_reason,
                           [logprobs] if logprobs is not None else None)

    def _fail(self, requests: Sequence[Request], message: str) -> list[StreamDelta]:
        deltas = []
        for request in requests:
            owner = self._seq_owner.get(request.request_id)
            if owner is None:
                continue
            self.scheduler.finish_request(request.request_id, FinishReason.ERROR, message)
            group, index = owner
            sample = group.samples[index]
            sample.finish_reason, sample.error = FinishReason.ERROR.value, message
            self._release(request.request_id)
            deltas.append(StreamDelta(group.request_id, index, "", [], sample.finish_reason, None, message))
            # A group that fails before its first token never forks its other n - 1 samples;
            # fail them too, or the group could never close (and its caller would wait forever).
            while len(group.samples) < group.params.n:
                missing = self._add_sample(group, f"{group.request_id}#{len(group.samples)}")
                missing.finish_reason, missing.error = FinishReason.ERROR.value, message
                self._release(missing.seq_id)
                deltas.append(StreamDelta(group.request_id, len(group.samples) - 1, "", [], missing.finish_reason,
                                          None, message))
            self._maybe_close(group)
        return deltas

    def _maybe_close(self, group: _Group) -> None:
        if group.finished:
            group.metrics.finished_time = time.monotonic()
            self._finished_outputs[group.request_id] = self._groups.pop(group.request_id, group)

    # ------------------------------------------------------------------ results
    def take_finished(self) -> dict[str, RequestOutput]:
        """Final outputs of the requests that ended since the last call."""
        done, self._finished_outputs = self._finished_outputs, {}
        return {rid: self.to_output(g) for rid, g in done.items()}

    def to_output(self, group: _Group) -> RequestOutput:
        outputs = [
            CompletionOutput(i, s.detokenizer.text if s.detokenizer else "", list(s.token_ids), s.finish_reason,
                             s.logprobs, s.cumulative_logprob if s.logprobs is not None else None, s.error)
            for i, s in enumerate(group.samples)
        ]
        return RequestOutput(group.request_id, group.prompt, list(group.prompt_token_ids), outputs,
                             group.finished, group.metrics)

    def stats(self) -> dict:
        stats = self.scheduler.stats()
        stats["num_step_errors"] = self.num_step_errors
        stats["prompt_tokens"] = self.num_prompt_tokens
        stats["generation_tokens"] = self.num_generation_tokens
        stats.update(self.step_stats.summary())
        return stats


@dataclass
class _StepStats:
    """Running aggregates over the steps that ran (for demos and benchmarks)."""

    num_steps: int = 0
    usage_sum: float = 0.0
    fragmentation_sum: float = 0.0
    peak_usage: float = 0.0
    peak_running: int = 0

    def record(self, scheduler: Scheduler) -> None:
        pool = scheduler.pool
        self.num_steps += 1
        self.usage_sum += pool.usage
        self.fragmentation_sum += pool.fragmentation
        self.peak_usage = max(self.peak_usage, pool.usage)
        self.peak_running = max(self.peak_running, scheduler.num_running)

    def summary(self) -> dict:
        steps = max(self.num_steps, 1)
        return {"num_steps": self.num_steps, "mean_kv_cache_usage": self.usage_sum / steps,
                "mean_kv_fragmentation": self.fragmentation_sum / steps,
                "peak_kv_cache_usage": self.peak_usage, "peak_num_running": self.peak_running}


def _sampling_error(exc: Exception) -> str:
    return f"sampling failed: {type(exc).__name__}: {exc}"


def _check_logits_shape(logits: Any, num_rows: int) -> None:
    """A runner that returns the wrong shape has failed its step (caught like any model fault)."""
    shape = tuple(getattr(logits, "shape", ()))
    if len(shape) != 2 or shape[0] != num_rows:
        raise RuntimeError(f"the runner returned logits of shape {shape}; expected ({num_rows}, vocab)")


def _child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sample ``index`` of a group: one sample, its own seed derived from the group's."""
    seed = None if params.seed is None else params.seed + index
    return dataclasses.replace(params, n=1, seed=seed)


def _with_stop_ids(params: SamplingParams, extra: tuple) -> SamplingParams:
    return dataclasses.replace(params, stop_token_ids=tuple(params.stop_token_ids) + extra)
