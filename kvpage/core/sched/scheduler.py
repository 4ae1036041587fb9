"""Iteration-level scheduler: decides, once per model step, which tokens run.

Policy per step (``max_num_batched_tokens`` is the token budget; the decisions themselves
are ``policy``'s):
  1. Running requests first: every decode (one token each), then the next chunk of each
     partially computed prompt, each group in scheduling order (``Request.sort_key``), so a
     long prefill never starves running decodes. When blocks run out, the newest running
     request not yet scheduled this step is preempted (its blocks freed, to be recomputed
     later) until the current one fits. With a step-time target (``max_step_ms``), the
     prompt chunks get only what the target leaves once the decodes are in (``StepBudget``).
  2. If nothing was preempted, waiting requests are admitted in order while the budget,
     ``max_num_seqs`` and the pool allow (``Admission``), each after a prefix-cache lookup.
  3. With lower KV tiers (``KVOffloadManager``), a hit continues past the pool: host
     blocks are loaded before the step's forward and count as cached tokens; a hit that
     continues on disk parks the request (``FetchWaits``) until those blocks are read
     into host memory. The byte copies come out of the step as ``SchedulerOutput.kv_transfers``
     and, after a successful step, ``tiers.take_saves`` (write-through to disk); see
     ``TierScheduling``.

The mechanics of blocks live in ``KVCacheManager``; this module only picks who runs.
"""
from __future__ import annotations

import bisect
import itertools
import time
from typing import Mapping, Optional, Sequence

import numpy as np

from kvpage.core.block_hash import BlockHash
from kvpage.core.config import CacheConfig, SchedulerConfig
from kvpage.core.kv.block_pool import BlockPool
from kvpage.core.kv.kv_cache_manager import KVCacheManager
from kvpage.core.kv.radix_cache import RadixCache
from kvpage.core.kv.state_slots import StateSlotPool
from kvpage.core.kv_events import KVCacheEvent, KVEventLog
from kvpage.core.offload.kv_offload import KVOffloadManager
from kvpage.core.request import FinishReason, Request, RequestStatus, sample_request_id
from kvpage.core.sampling_params import SamplingParams
from kvpage.core.sched.admission import Admission
from kvpage.core.sched.fetch_waits import FetchWaits
from kvpage.core.sched.integrity import check_block_holders, check_state_holders
from kvpage.core.sched.metadata import build_step_metadata
from kvpage.core.sched.output import QueueFullError, SchedulerOutput
from kvpage.core.sched.policy import pick_victim, sort_key, split_running, stop_reason
from kvpage.core.sched.step_budget import StepCost, step_budget
from kvpage.core.sched.step_plan import StepPlan
from kvpage.core.sched.tier_scheduling import TierScheduling
from kvpage.core.sched.waiting_queue import WaitingQueue


class Scheduler:
    """Continuous batching over a paged KV cache. Not thread-safe: drive it from one loop.

    ``step_cost``: the cost model behind ``max_step_ms`` (default: a ``StepCostModel`` fitted
    to the steps reported through ``observe_step``); unused without ``max_step_ms``.
    """

    def __init__(self, cache_config: CacheConfig, scheduler_config: SchedulerConfig,
                 step_cost: Optional[StepCost] = None) -> None:
        if not isinstance(cache_config, CacheConfig) or not isinstance(scheduler_config, SchedulerConfig):
            raise ValueError(f"Scheduler takes a CacheConfig and a SchedulerConfig, got "
                             f"{type(cache_config).__name__} and {type(scheduler_config).__name__}")
        scheduler_config.check_against(cache_config)
        self.cache_config = cache_config
        self.config = scheduler_config
        self.block_size = cache_config.block_size
        self.pool = BlockPool(cache_config.num_blocks, cache_config.block_size, len(cache_config.group_windows))
        self.kv_events = KVEventLog(cache_config.enable_kv_events)
        self.offload = None
        if cache_config.num_host_blocks:
            self.offload = KVOffloadManager(self.block_size, cache_config.num_host_blocks,
                                            cache_config.num_disk_blocks, self.kv_events)
        windows = cache_config.group_windows
        self.prefix_cache = (RadixCache(self.pool, self.offload, self.kv_events, windows)
                             if cache_config.enable_prefix_caching else None)
        self.state_slots = StateSlotPool(cache_config.num_state_slots) if cache_config.num_state_slots else None
        self.kv = KVCacheManager(self.pool, self.prefix_cache, self.offload, windows, self.state_slots)
        self.waiting = WaitingQueue(scheduler_config.policy)
        self.fetch_waits = FetchWaits()
        # The lower tiers' side of scheduling (parking, completions, disk saves); None without tiers.
        self.tiers = TierScheduling(self.offload, self.kv, self.waiting, self.fetch_waits) if self.offload else None
        self.admission = Admission(scheduler_config, self.kv, self.waiting, self.prefix_cache, self.tiers)
        self.step_budget = step_budget(scheduler_config.max_step_ms, self.block_size,
                                       scheduler_config.max_num_batched_tokens, step_cost)
        self.running: list[Request] = []  # kept sorted by sort_key (insort), never re-sorted per step
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_thrash_pins = 0  # requests pinned against further preemption
        self.num_steps = 0
        self._arrivals = itertools.count()  # arrival order of this scheduler's requests
        # The step whose results update_from_output has yet to apply (one at a time).
        self._unapplied: Optional[SchedulerOutput] = None

    # ------------------------------------------------------------------ intake
    def add_request(self, request: Request) -> None:
        """Queue ``request``. Raises ``ValueError`` if it can never run, ``QueueFullError`` if full."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self._check_fits(request)
        if request.sampling_params.n > self.config.max_num_seqs:
            raise ValueError(f"n={request.sampling_params.n} exceeds max_num_seqs={self.config.max_num_seqs}")
        limit = self.config.max_waiting
        if limit is not None and self.num_waiting >= limit:
            raise QueueFullError(f"the waiting queue is full ({limit} requests); retry later")
        request.status = RequestStatus.WAITING
        request.arrival_order = next(self._arrivals)
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
        blocks = self.kv.blocks_held(worst_case, min(worst_case, self.config.max_num_batched_tokens))
        if blocks > self.pool.num_blocks:
            raise ValueError(
                f"request {request.request_id!r}: up to {worst_case} KV tokens need {blocks} blocks, "
                f"but the pool has only {self.pool.num_blocks} ({self.pool.num_blocks * self.block_size} tokens)"
            )

    def make_request(self, request_id: str, prompt_token_ids: Sequence[int], *args, **kwargs) -> Request:
        """Build a ``Request`` (same arguments) and queue it in one call; returns it."""
        request = Request(request_id, prompt_token_ids, *args, **kwargs)
        self.add_request(request)
        return request

    # ------------------------------------------------------------------ queries
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        """Requests not running yet: queued, or parked while their prefix is read from disk."""
        return len(self.waiting) + len(self.fetch_waits)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or self.num_waiting > 0

    # ------------------------------------------------------------------ the step
    def schedule(self) -> SchedulerOutput:
        """Pick this step's work and build its metadata. Call ``update_from_output`` next (a
        step that failed instead ends its requests, ``finish_requests``, before the next one);
        scheduling again before that is a ``ValueError``: the tokens would be scheduled twice."""
        pending = self._unapplied
        if pending is not None and any(r.status is RequestStatus.RUNNING for r in pending.requests):
            raise ValueError("the previous step's results were not applied: call update_from_output "
                             "(or end its requests) before scheduling the next step")
        plan = StepPlan(self.config.max_num_batched_tokens)
        decodes, prefills = split_running(self.running)
        self._schedule_running(plan, decodes)
        if self.step_budget is not None:
            plan.cap(self.step_budget.limit(plan.num_tokens, len(plan.scheduled)))
        self._schedule_running(plan, prefills)
        if not plan.preempted:
            self.admission.admit(plan, self.running)
        return self._emit(plan)

    def _schedule_running(self, plan: StepPlan, requests: list[Request]) -> None:
        """Schedule the next tokens of running ``requests``, in order, while the budget lasts."""
        for request in requests:
            if plan.budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this step as a victim
            num_new = request.num_uncomputed_tokens
            if self.config.enable_chunked_prefill:
                num_new = min(num_new, plan.budget)
            if num_new == 0 or num_new > plan.budget:
                continue
            if self._make_room(plan, request, num_new):
                plan.add(request, num_new, self.kv)

    def observe_step(self, num_tokens: int, num_seqs: int, seconds: float) -> None:
        """Report a successful step: its tokens, its sequences and the wall seconds of its work
        after scheduling. Feeds the step-time budget; a no-op without ``max_step_ms``."""
        if self.step_budget is not None:
            self.step_budget.observe(num_tokens, num_seqs, seconds)

    def _make_room(self, plan: StepPlan, request: Request, num_new: int) -> bool:
        """Allocate ``request``'s slots, preempting victims (``policy.pick_victim``) until they
        fit; False if ``request`` itself was the victim."""
        while not self.kv.allocate_slots(request, num_new):
            victim = pick_victim(self.running, plan.scheduled_ids(), self.config.max_preemptions_before_pin)
            self._preempt(victim)
            plan.preempted.append(victim)
            if victim is request:
                return False
        return True

    def _emit(self, plan: StepPlan) -> SchedulerOutput:
        # Decodes (query length 1) first: attention backends split the batch there.
        plan.scheduled.sort(key=lambda item: item[1] != 1)
        requests = [r for r, _ in plan.scheduled]
        counts = [n for _, n in plan.scheduled]
        copies = self.kv.take_pending_copies(requests)
        metadata = build_step_metadata(requests, counts, self.block_size, copies, self.kv.num_groups,
                                       self.kv.take_state_copies())
        self.num_steps += 1
        transfers = self.offload.take_step_transfers() if self.offload is not None else None
        output = SchedulerOutput(requests, counts, metadata, plan.preempted, plan.newly_cached[::-1],
                                 kv_transfers=transfers)
        self._unapplied = output
        return output

    def discard_step_cache(self, output: SchedulerOutput) -> int:
        """After a failed step: forget the cache entries it created, now that their holders ended.

        Call once the step's requests are finished; returns the number of blocks forgotten.
        """
        if self.prefix_cache is None:
            return 0
        return self.prefix_cache.discard(output.newly_cached_blocks)

    def reset_prefix_cache(self) -> list[BlockHash]:
        """Empty every tier (``AllBlocksCleared``); returns the disk hashes whose files to delete.

        Raises ``ValueError`` while any cached block is in use.
        """
        if self.prefix_cache is None:
            return []
        self.prefix_cache.reset()
        dropped = self.tiers.clear() if self.tiers is not None else []
        self.kv_events.take()  # the per-block removals are subsumed by one clear
        self.kv_events.cleared()
        return dropped

    def take_kv_events(self) -> list[KVCacheEvent]:
        """KV events since the last call, in order (empty unless ``enable_kv_events``)."""
        return self.kv_events.take()

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
                           fork_token_ids: Optional[Mapping[int, Sequence[int]]] = None) -> list[Request]:
        """Advance the step's requests; return those that finished (EOS, stop id, length).

        ``sampled_token_ids[j]`` belongs to ``output.metadata.sample_seq_indices[j]``.
        ``fork_token_ids[j]`` gives the first tokens of the other ``n - 1`` samples of row
        ``j``'s request (``n > 1``, at its first token): each is forked off the row's
        sequence, sharing its blocks copy-on-write, and listed in ``output.forked[j]``. A
        request with ``n > 1`` forked neither here nor by ``fork_request`` yields one sample.
        Requests that ended while the step ran (aborted, failed) are skipped. Each output is
        applied once, the latest ``schedule``'s; anything else, or a bad token or fork, is a
        ``ValueError`` that changes nothing.
        """
        if output is not self._unapplied:
            raise ValueError("this step output is not the latest schedule()'s, or was applied already")
        tokens = _token_ids("sampled_token_ids", sampled_token_ids)
        seq_of_sample = output.metadata.sample_seq_indices
        if len(tokens) != seq_of_sample.shape[0]:
            raise ValueError(f"expected {seq_of_sample.shape[0]} sampled tokens (one per "
                             f"metadata.sample_seq_indices row), got {len(tokens)}")
        forks = _check_forks(output, fork_token_ids or {})
        self._unapplied = None
        row_of_seq = {seq: row for row, seq in enumerate(seq_of_sample.tolist())}
        now = time.monotonic()
        finished: list[Request] = []
        sliding = bool(self.kv.sliding_groups)
        for i, (request, num_new) in enumerate(zip(output.requests, output.num_new_tokens)):
            if request.status is not RequestStatus.RUNNING:
                continue
            request.num_computed_tokens += num_new
            if sliding:
                self.kv.release_out_of_window(request)
            row = row_of_seq.get(i)
            if row is None:
                continue  # a prefill chunk that produced no token
            if row in forks:
                output.forked[row] = self._fork_samples(request, forks[row], now, finished)
            self._append_token(request, tokens[row], now, finished)
        return finished

    def _fork_samples(self, parent: Request, first_tokens: Sequence[int], now: float,
                      finished: list[Request]) -> list[Request]:
        """Fork samples 1..n-1 of ``parent``'s request, each with its first token appended."""
        children = []
        for index, token in enumerate(first_tokens, start=1):
            child_id = sample_request_id(parent.group_id, index, parent.sampling_params.n)
            child = self.fork_request(parent.request_id, child_id, parent.sampling_params.for_sample(index),
                                      sample_index=index, check_seats=False)
            self._append_token(child, int(token), now, finished)
            children.append(child)
        return children

    def _append_token(self, request: Request, token: int, now: float, finished: list[Request]) -> None:
        request.all_token_ids.append(token)
        if request.first_token_time is None:
            request.first_token_time = now
        request.last_token_time = now
        reason = stop_reason(request, token, self.config.max_model_len)
        if reason is not None:
            self._finish(request, reason)
            finished.append(request)

    # ------------------------------------------------------------------ endings
    def _finish(self, request: Request, reason: FinishReason, error: Optional[str] = None) -> None:
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.discard(request.request_id)
            if self.tiers is not None:
                self.tiers.ended(request)
        self.kv.free(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.error = error
        request.finish_time = time.monotonic()
        del self.requests[request.request_id]

    def finish_request(self, request_id: str, reason: FinishReason, error: Optional[str] = None) -> Optional[Request]:
        """End a live request (stop string, abort, error); frees its blocks. Unknown ids return None."""
        if not isinstance(reason, FinishReason):
            raise ValueError(f"reason must be a FinishReason, got {reason!r}")
        request = self.requests.get(request_id)
        if request is None:
            return None
        self._finish(request, reason, error)
        return request

    def finish_requests(self, request_ids: Sequence[str], reason: FinishReason,
                        error: Optional[str] = None) -> list[Request]:
        """``finish_request`` for each id; returns the requests that were live."""
        if isinstance(request_ids, (str, bytes)):
            raise ValueError(f"request_ids must be a collection of ids, not one id ({request_ids!r})")
        ended = (self.finish_request(rid, reason, error) for rid in request_ids)
        return [r for r in ended if r is not None]

    def abort(self, request_id: str) -> bool:
        """Abort a queued or running request; returns False if it is not live."""
        return self.finish_request(request_id, FinishReason.ABORT) is not None

    def fork_request(self, parent_id: str, child_id: str, sampling_params: Optional[SamplingParams] = None,
                     sample_index: int = 0, check_seats: bool = True) -> Request:
        """Start ``child_id`` as a running copy of a running request, sharing its blocks.

        The child continues from the parent's tokens; its first append into a shared partial
        block gets a private copy, reported through ``StepMetadata.block_copies``. The one
        fork path: parallel sampling forks here too (its seats were reserved at admission,
        hence ``check_seats=False``).
        """
        parent = self.requests.get(parent_id)
        if parent is None or parent.status is not RequestStatus.RUNNING:
            raise ValueError(f"request {parent_id!r} is not running and cannot be forked")
        if child_id in self.requests:
            raise ValueError(f"request id {child_id!r} is already in use")
        if check_seats and len(self.running) >= self.config.max_num_seqs:
            raise ValueError(f"cannot fork {parent_id!r}: max_num_seqs={self.config.max_num_seqs} are running")
        child = Request(child_id, parent.prompt_token_ids, sampling_params or parent.sampling_params,
                        parent.eos_token_id, parent.namespace, parent.arrival_time, parent.group_id, sample_index)
        child.all_token_ids = list(parent.all_token_ids)
        child.block_hashes = list(parent.block_hashes)
        child.num_prompt_tokens = parent.num_prompt_tokens
        child.arrival_order = next(self._arrivals)  # unique: sort keys never tie
        child.first_token_time = parent.first_token_time
        child.prefix_queried = True  # its prompt was counted with the parent
        self.kv.fork(parent, child)
        child.status = RequestStatus.RUNNING
        self.requests[child_id] = child
        bisect.insort(self.running, child, key=sort_key)
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
            "kv_groups": self.kv.group_stats(),
            "prefix_cache_queries": cache.num_queried_tokens if cache else 0,
            "prefix_cache_hits": cache.num_hit_tokens if cache else 0,
            "num_preemptions": self.num_preemptions,
            "num_thrash_pins": self.num_thrash_pins,
            "num_running": self.num_running,
            "num_waiting": self.num_waiting,
            **(self.step_budget.stats() if self.step_budget is not None else {}),
            **self._tier_stats(),
        }

    def _tier_stats(self) -> dict:
        if self.tiers is None:
            return {}
        return {**self.tiers.stats(self.block_size), "kv_pool_evictions": self.prefix_cache.num_evicted_blocks}

    def check_integrity(self) -> None:
        """Assert pool, cache and request tables agree: every reference has a holder."""
        if self.prefix_cache is not None:
            self.prefix_cache.check_integrity()
        else:
            self.pool.check_integrity()
        if self.tiers is not None:
            self.tiers.check_integrity()
        check_block_holders(self.kv, self.requests.values())
        assert len(self.running) <= self.config.max_num_seqs
        if self.state_slots is not None:
            check_state_holders(self.state_slots, self.requests.values())


def _token_ids(name: str, values) -> list[int]:
    """``values`` (one dimension) as a list of token ids; ``ValueError`` unless integers >= 0."""
    array = np.asarray(values)
    if array.ndim != 1 or (array.size and (array.dtype.kind not in "iu" or array.min() < 0)):
        raise ValueError(f"{name} must be a sequence of token ids (integers >= 0), got {values!r}")
    return array.astype(np.int64).tolist()


def _check_forks(output: SchedulerOutput, fork_token_ids: Mapping[int, Sequence[int]]) -> dict[int, list[int]]:
    """``fork_token_ids`` checked against the step: only a running row whose request draws
    its first token with ``n > 1`` forks, into exactly ``n - 1`` samples. Only the rows
    given are looked at (most steps fork nothing)."""
    if not isinstance(fork_token_ids, Mapping):
        raise ValueError(f"fork_token_ids must map sampled rows to token ids, got {type(fork_token_ids).__name__}")
    seq_of_row = output.metadata.sample_seq_indices.tolist()
    unknown = [row for row in fork_token_ids if row not in range(len(seq_of_row))]
    if unknown:
        raise ValueError(f"fork_token_ids names rows {sorted(unknown, key=str)} of {len(seq_of_row)} sampled rows")
    forks = {}
    for row, tokens in fork_token_ids.items():
        request = output.requests[seq_of_row[row]]
        if request.status is not RequestStatus.RUNNING:
            continue  # (a request that ended while the step ran forks nothing)
        n = request.sampling_params.n
        if n == 1 or request.num_output_tokens:
            raise ValueError(f"fork_token_ids[{row}]: request {request.request_id!r} (n={n}) forks only "
                             "at the first token of a request with n > 1")
        forks[row] = _token_ids(f"fork_token_ids[{row}]", tokens)
        if len(forks[row]) != n - 1:
            raise ValueError(f"fork_token_ids[{row}]: request {request.request_id!r} has n={n}, "
                             f"so {n - 1} other samples, got {len(forks[row])} tokens")
    return forks
