"""What one scheduler step hands to the layers above it.

Kept apart from the scheduler so that the modules that read a step (the tier scheduling, the
engine, the model runner) never import the scheduler itself.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from kvpage.core.offload.kv_transfers import KVTransfers
from kvpage.core.request import Request
from kvpage.core.sched.metadata import StepMetadata


class QueueFullError(RuntimeError):
    """The waiting queue is at ``max_waiting``; retry later (HTTP 503)."""


@dataclass(slots=True)
class SchedulerOutput:
    """One step: the requests to run (in metadata order) and their flat metadata.

    ``forked[j]`` lists the samples that ``update_from_output`` forked off sampled row ``j``
    (parallel sampling, ``n > 1``); it is filled in by that call.
    """

    requests: list[Request]
    num_new_tokens: list[int]
    metadata: StepMetadata
    preempted: list[Request] = field(default_factory=list)
    # Blocks entered into the prefix cache for this step, tail first; their KV is only
    # valid once the step succeeds (see ``Scheduler.discard_step_cache``).
    newly_cached_blocks: list[int] = field(default_factory=list)
    forked: dict[int, list[Request]] = field(default_factory=dict)
    # Copies between the pool and the lower tiers to run before the forward (None: none).
    kv_transfers: Optional[KVTransfers] = None

    @property
    def is_empty(self) -> bool:
        return not self.requests

    @property
    def sampled_requests(self) -> list[Request]:
        """The request of each sampled row (``metadata.sample_seq_indices`` order)."""
        return [self.requests[i] for i in self.metadata.sample_seq_indices.tolist()]

    @property
    def prompt_logits_requests(self) -> list[Request]:
        """The request of each prompt row (``metadata.prompt_logits_seq_indices`` order)."""
        return [self.requests[i] for i in self.metadata.prompt_logits_seq_indices.tolist()]
