"""Iteration-level scheduler: decides, once per model step, which tokens run.

Policy per step (``max_num_batched_tokens`` is the token budget):
  1. Running requests first: every decode (one token each), then the next chunk of each
     partially computed prompt, each group in scheduling order (``Request.sort_key``), so a
     long prefill never starves running decodes. When blocks run out, the newest running
     request not yet scheduled this step is preempted (its blocks freed, to be recomputed
     later) until the current one fits.
  2. If nothing was preempted, waiting requests are admitted in order while the budget,
     ``max_num_seqs`` and the pool allow. Each consults the prefix cache first, so cached
     tokens are never recomputed. Without chunked prefill a prompt runs whole or waits.

The mechanics of blocks live in ``KVCacheManager``; this module only picks who runs.
"""
from __future__ import annotations

import bisect
import itertools
import time
from dataclasses import dataclass, field
from typing import Hashable, Mapping, Optional, Sequence

import numpy as np

from .block_pool import BlockPool
from .config import CacheConfig, SchedulerConfig
from .kv_cache_manager import KVCacheManager, cdiv
from .metadata import StepMetadata, build_step_metadata
from .radix_cache import RadixCache
from .request import FinishReason, Request, RequestStatus
from .sampling_params import SamplingParams
from .waiting_queue import WaitingQueue


def _sort_key(request: Request) -> tuple:
    return request.sort_key


class QueueFullError(RuntimeError):
    """The waiting queue is at ``max_waiting``; retry later (HTTP 503)."""


@dataclass(slots=True)
class SchedulerOutput:
    """One step: the requests to run (in metadata order) and their flat metadata."""

    requests: list[Request]
    num_new_tokens: list[int]
    metadata: StepMetadata
    preempted: list[Request] = field(default_factory=list)
    # Blocks entered into the prefix cache for this step, tail first; their KV is only
    # valid once the step succeeds (see ``Scheduler.discard_step_cache``).
    newly_cached_blocks: list[int] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.requests


def _seats(request: Request) -> int:
    """Running slots a request will take: ``n`` before its first token (its samples fork then)."""
    return request.sampling_params.n if request.num_output_tokens == 0 else 1


class Scheduler:
    """Continuous batching over a paged KV cache. Not thread-safe: drive it from one loop."""

    def __init__(self, cache_config: CacheConfig, scheduler_config: SchedulerConfig) -> None:
        scheduler_config.check_against(cache_config)
        self.cache_config = cache_config
        self.config = scheduler_config
        self.block_size = cache_config.block_size
        self.pool = BlockPool(cache_config.num_blocks, cache_config.block_size)
        self.prefix_cache = RadixCache(self.pool) if cache_config.enable_prefix_caching else None
        self.kv = KVCacheManager(self.pool, self.prefix_cache)
        self.waiting = WaitingQueue(scheduler_config.policy)
        self.running: list[Request] = []  # kept sorted by sort_key (insort), never re-sorted per step
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_thrash_pins = 0  # requests pinned against further preemption
        self.num_steps = 0
        self._step_cached: list[int] = []  # blocks cached while building the current step

    # ------------------------------------------------------------------ intake
    def add_request(self, request: Request) -> None:
        """Queue ``request``. Raises ``ValueError`` if it can never run, ``QueueFullError`` if full."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self._check_fits(request)
        if request.sampling_params.n > self.config.max_num_seqs:
            raise ValueError(f"n={request.sampling_params.n} exceeds max_num_seqs={self.config.max_num_seqs}")
        limit = self.config.max_waiting
        if limit is not None and len(self.waiting) >= limit:
            raise QueueFullError(f"the waiting queue is full ({limit} requests); retry later")
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.push(request)

    def _check_fits(self, request: Request) -> None:
        max_len = self.config.max_model_len
        if request.num_tokens >= max_len:
            raise ValueError(
                f"request {request.request_id!r}: prompt of {request.num_tokens} tokens leaves no room "
                f"to generate within max_model_len={max_len}"
            )
        # The last token is sampled but never fed back, so its KV is never stored.
        worst_case = min(request.num_tokens + request.sampling_params.max_tokens, max_len) - 1
        blocks = cdiv(worst_case, self.block_size)
        if blocks > self.pool.num_blocks:
            raise ValueError(
                f"request {request.request_id!r}: up to {worst_case} KV tokens need {blocks} blocks, "
                f"but the pool has only {self.pool.num_blocks} ({self.pool.num_blocks * self.block_size} tokens)"
            )

    def make_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: Optional[SamplingParams] = None,
        eos_token_id: Optional[int] = None,
        namespace: Hashable = None,
    ) -> Request:
        """Build and queue a request in one call; returns it."""
        request = Request(request_id, prompt_token_ids, sampling_params, eos_token_id, namespace)
        self.add_request(request)
        return request

    # ------------------------------------------------------------------ queries
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    # ------------------------------------------------------------------ the step
    def schedule(self) -> SchedulerOutput:
        """Pick this step's work and build its metadata. Call ``update_from_output`` next."""
        budget = self.config.max_num_batched_tokens
        chunked = self.config.enable_chunked_prefill
        scheduled: list[tuple[Request, int]] = []
        preempted: list[Request] = []
        self._step_cached: list[int] = []

        decodes: list[Request] = []
        prefills: list[Request] = []
        for request in self.running:
            (decodes if request.num_uncomputed_tokens == 1 else prefills).append(request)
        for request in itertools.chain(decodes, prefills):
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this step as a victim
            num_new = request.num_uncomputed_tokens
            if chunked:
                num_new = min(num_new, budget)
            if num_new == 0 or num_new > budget:
                continue
            while not self.kv.allocate_slots(request, num_new):
                victim = self._pick_victim(scheduled)
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            else:
                self._schedule_one(scheduled, request, num_new)
                budget -= num_new

        if not preempted:
            budget = self._admit_waiting(scheduled, budget, chunked)
        return self._emit(scheduled, preempted)

    def _pick_victim(self, scheduled: list[tuple[Request, int]]) -> Request:
        """Newest running request not yet scheduled this step, sparing pinned ones if possible."""
        taken = {id(r) for r, _ in scheduled}
        candidates = [r for r in self.running if id(r) not in taken]
        unpinned = [r for r in candidates if r.num_preemptions < self.config.max_preemptions_before_pin]
        pool = unpinned or candidates
        return max(pool, key=lambda r: r.sort_key)

    def _admit_waiting(self, scheduled: list[tuple[Request, int]], budget: int, chunked: bool) -> int:
        while budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.peek()
            if request is None:
                break
            if len(self.running) + _seats(request) > self.config.max_num_seqs:
                break  # its parallel samples will fork into seats of their own
            hit = self.kv.match_prefix(request)
            num_new = request.num_tokens - hit.num_tokens
            if chunked:
                num_new = min(num_new, budget)
            elif num_new > budget:
                break
            if not self.kv.allocate_slots(request, num_new, hit):
                break
            self.waiting.pop()
            if self.prefix_cache is not None and not request.prefix_queried:
                # Count each request once: a recompute after preemption hits its own blocks.
                request.prefix_queried = True
                self.prefix_cache.record_query(request.num_tokens, hit.num_tokens)
            request.status = RequestStatus.RUNNING
            bisect.insort(self.running, request, key=_sort_key)
            self._schedule_one(scheduled, request, num_new)
            budget -= num_new
        return budget

    def _emit(self, scheduled: list[tuple[Request, int]], preempted: list[Request]) -> SchedulerOutput:
        # Decodes (query length 1) first: attention backends split the batch there.
        scheduled.sort(key=lambda item: item[1] != 1)
        requests = [r for r, _ in scheduled]
        counts = [n for _, n in scheduled]
        metadata = build_step_metadata(requests, counts, self.block_size, self.kv.take_pending_copies())
        self.num_steps += 1
        return SchedulerOutput(requests, counts, metadata, preempted, self._step_cached[::-1])

    def _schedule_one(self, scheduled: list[tuple[Request, int]], request: Request, num_new: int) -> None:
        scheduled.append((request, num_new))
        if (request.num_computed_tokens + num_new) // self.block_size > request.num_inserted_blocks:
            self._step_cached.extend(self.kv.cache_scheduled_blocks(request, num_new))

    def discard_step_cache(self, output: SchedulerOutput) -> int:
        """After a failed step: forget the cache entries it created, now that their holders ended.

        Call once the step's requests are finished; returns the number of blocks forgotten.
        """
        if self.prefix_cache is None:
            return 0
        return self.prefix_cache.discard(output.newly_cached_blocks)

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        self.running.remove(request)
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        if request.num_preemptions == self.config.max_preemptions_before_pin:
            self.num_thrash_pins += 1
        self.num_preemptions += 1
        self.waiting.push_front(request)

    # ------------------------------------------------------------------ after the step
    def update_from_output(self, output: SchedulerOutput, sampled_token_ids: Sequence[int],
                           forks: Optional[Mapping[int, Sequence[tuple[Request, int]]]] = None) -> list[Request]:
        """Advance the step's requests. ``sampled_token_ids[j]`` belongs to
        ``output.metadata.sample_seq_indices[j]``. Returns the requests that finished.

        ``forks[j]`` lists ``(child, token)`` pairs for sampled row ``j``: each fresh
        ``child`` request starts as a copy of that row's sequence (sharing its blocks,
        copy-on-write) with ``token`` as its first sampled token (parallel sampling, ``n > 1``).
        """
        sampled = np.asarray(sampled_token_ids, dtype=np.int64).reshape(-1)
        seq_of_sample = output.metadata.sample_seq_indices
        if sampled.shape[0] != seq_of_sample.shape[0]:
            raise ValueError(f"expected {seq_of_sample.shape[0]} sampled tokens, got {sampled.shape[0]}")
        token_of_seq: dict[int, int] = dict(zip(seq_of_sample.tolist(), sampled.tolist()))
        row_of_seq = {seq: row for row, seq in enumerate(seq_of_sample.tolist())} if forks else {}
        now = time.monotonic()
        finished: list[Request] = []
        for i, (request, num_new) in enumerate(zip(output.requests, output.num_new_tokens)):
            if request.status is not RequestStatus.RUNNING:
                continue  # aborted or finished while the step ran
            request.num_computed_tokens += num_new
            token = token_of_seq.get(i)
            if token is None:
                continue  # a prefill chunk that produced no token
            if forks:
                for child, child_token in forks.get(row_of_seq[i], ()):
                    self._attach_fork(request, child)
                    self._append_token(child, child_token, now, finished)
            self._append_token(request, token, now, finished)
        return finished

    def _append_token(self, request: Request, token: int, now: float, finished: list[Request]) -> None:
        request.all_token_ids.append(token)
        if request.first_token_time is None:
            request.first_token_time = now
        request.last_token_time = now
        reason = self._stop_reason(request, token)
        if reason is not None:
            self._finish(request, reason)
            finished.append(request)

    def _attach_fork(self, parent: Request, child: Request) -> None:
        """Make ``child`` a running copy of ``parent`` that shares its blocks."""
        if child.request_id in self.requests:
            raise ValueError(f"request id {child.request_id!r} is already in use")
        child.all_token_ids = list(parent.all_token_ids)
        child.num_prompt_tokens = parent.num_prompt_tokens
        child.arrival_time = parent.arrival_time
        self.kv.fork(parent, child)
        child.status = RequestStatus.RUNNING
        child.prefix_queried = True  # its prompt was counted with the parent
        self.requests[child.request_id] = child
        bisect.insort(self.running, child, key=_sort_key)

    def _stop_reason(self, request: Request, token: int) -> Optional[FinishReason]:
        params = request.sampling_params
        produced = request.num_output_tokens
        if produced >= params.min_tokens:
            if token in params.stop_token_ids:
                return FinishReason.STOP
            if not params.ignore_eos and request.eos_token_id is not None and token == request.eos_token_id:
                return FinishReason.STOP
        if produced >= params.max_tokens or request.num_tokens >= self.config.max_model_len:
            return FinishReason.LENGTH
        return None

    # ------------------------------------------------------------------ endings
    def _finish(self, request: Request, reason: FinishReason, error: Optional[str] = None) -> None:
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.discard(request.request_id)
        self.kv.free(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.error = error
        request.finish_time = time.monotonic()
        del self.requests[request.request_id]

    def finish_request(self, request_id: str, reason: FinishReason, error: Optional[str] = None) -> Optional[Request]:
        """End a live request (stop string, abort, error); frees its blocks. Unknown ids return None."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        self._finish(request, reason, error)
        return request

    def abort(self, request_id: str) -> bool:
        """Abort a queued or running request; returns False if it is not live."""
        return self.finish_request(request_id, FinishReason.ABORT) is not None

    def fork_request(self, parent_id: str, child_id: str, sampling_params: Optional[SamplingParams] = None) -> Request:
        """Start ``child_id`` as a copy of a running request, sharing its blocks (copy-on-write).

        The child continues from the parent's tokens; its first append into a shared partial
        block is given a private copy, reported through ``StepMetadata.block_copies``.
        """
        parent = self.requests.get(parent_id)
        if parent is None or parent.status is not RequestStatus.RUNNING:
            raise ValueError(f"request {parent_id!r} is not running and cannot be forked")
        if child_id in self.requests:
            raise ValueError(f"request id {child_id!r} is already in use")
        if len(self.running) >= self.config.max_num_seqs:
            raise ValueError(f"cannot fork {parent_id!r}: max_num_seqs={self.config.max_num_seqs} are running")
        child = Request(child_id, parent.prompt_token_ids, sampling_params or parent.sampling_params,
                        parent.eos_token_id, parent.namespace, parent.arrival_time)
        child.first_token_time = parent.first_token_time
        self._attach_fork(parent, child)
        return child

    # ------------------------------------------------------------------ observability
    def stats(self) -> dict:
        cache = self.prefix_cache
        return {
            "num_blocks": self.pool.num_blocks,
            "num_free_blocks": self.pool.num_free_blocks,
            "num_cached_blocks": self.pool.num_cached_blocks,
            "kv_cache_usage": self.pool.usage,
            "kv_fragmentation": self.pool.fragmentation,
            "prefix_cache_queries": cache.num_queried_tokens if cache else 0,
            "prefix_cache_hits": cache.num_hit_tokens if cache else 0,
            "num_preemptions": self.num_preemptions,
            "num_thrash_pins": self.num_thrash_pins,
            "num_running": self.num_running,
            "num_waiting": self.num_waiting,
        }

    def check_integrity(self) -> None:
        """Assert pool, cache and request tables agree: every reference has a holder."""
        if self.prefix_cache is not None:
            self.prefix_cache.check_integrity()
        else:
            self.pool.check_integrity()
        holders = [0] * self.pool.num_blocks
        for request in self.requests.values():
            if request.status is RequestStatus.WAITING:
                assert not request.block_ids, f"waiting {request!r} holds blocks"
            for b in request.block_ids:
                holders[b] += 1
            assert len(request.block_ids) * self.block_size >= request.num_computed_tokens
        for b in range(self.pool.num_blocks):
            assert holders[b] == self.pool.ref_count(b), f"block {b}: {holders[b]} holders, ref {self.pool.ref_count(b)}"
        assert len(self.running) <= self.config.max_num_seqs
