"""The contracts between the engine and what it drives: a model runner, a sampler, and the
optional KV tier agent and KV event publisher.

The engine is written against these Protocols only, so it imports no tensor library;
``kvpage.adapters`` (Hugging Face, torch) and ``kvpage.engine.sampler`` (torch) implement the
first two, ``kvpage.storage.tiers.agent.KVTierAgent`` (torch) and
``kvpage.engine.kv_events_publisher.ZmqEventPublisher`` (pyzmq) the others.
``Logits`` is whatever array type the runner produces and its sampler consumes
(a float32 ``torch.Tensor`` ``[S, vocab]`` for the HF runner); the engine only slices it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Protocol, Sequence, runtime_checkable

import numpy as np

from kvpage.core.block_hash import BlockHash
from kvpage.core.kv_events import KVCacheEvent
from kvpage.core.offload.kv_transfers import DiskOp, KVTransfers
from kvpage.core.request import Request
from kvpage.core.sched.metadata import StepMetadata

Logits = Any  # a 2-D array [S + R, vocab]: row j belongs to StepMetadata.logits_indices[j]


@runtime_checkable
class ModelRunner(Protocol):
    """Runs one scheduled step of a model over the paged KV cache."""

    def execute(self, metadata: StepMetadata) -> Logits:
        """Copy ``metadata.block_copies``, write the step's K/V by ``slot_mapping``, attend,
        and return float32 logits for ``metadata.logits_indices`` (in that order)."""
        ...


@dataclass(slots=True)
class SampleResult:
    """What a sampler drew for ``S`` rows.

    Attributes:
        token_ids: int64 [S], the token drawn for each row.
        logprobs: per row, None or {token_id: logprob} (top-k plus the drawn token).
        token_logprobs: float64 [S], the drawn token's log-probability (NaN unless asked).
        invalid_rows: rows whose logits were unusable (NaN, +inf, or all -inf); their
            tokens are meaningless and the engine fails those requests.
        forks: row -> the first tokens of that row's request's other ``n - 1`` samples,
            drawn from the same row (only for a request with ``n > 1`` at its first token).
    """

    token_ids: np.ndarray
    logprobs: list
    token_logprobs: np.ndarray
    invalid_rows: list = field(default_factory=list)
    forks: dict = field(default_factory=dict)  # int -> SampleResult of n - 1 rows

    @classmethod
    def merge(cls, parts: dict, num_rows: int) -> "SampleResult":
        """One result of ``num_rows`` rows from one-row results ``{row: result}``; rows
        that are missing (their sampling failed) get token 0 and no log-probabilities."""
        tokens, token_logprobs = np.zeros(num_rows, dtype=np.int64), np.full(num_rows, np.nan)
        logprobs: list = [None] * num_rows
        merged = cls(tokens, logprobs, token_logprobs)
        for row, part in parts.items():
            tokens[row], logprobs[row], token_logprobs[row] = part.token_ids[0], part.logprobs[0], part.token_logprobs[0]
            if part.invalid_rows:
                merged.invalid_rows.append(row)
            if 0 in part.forks:
                merged.forks[row] = part.forks[0]
        return merged


@runtime_checkable
class Sampler(Protocol):
    """Turns logits into tokens, honouring each request's ``SamplingParams``."""

    def sample(self, logits: Logits, requests: Sequence[Request]) -> SampleResult:
        """Row ``i`` of ``logits`` belongs to ``requests[i]``. Raises on a row it cannot draw."""
        ...

    def prompt_logprobs(self, logits: Logits, token_ids: np.ndarray, num_top: Sequence[int]) -> list:
        """Row ``r`` predicts prompt token ``token_ids[r]``: one ``outputs.PromptTokenLogprob``
        per row, with the ``num_top[r]`` most likely tokens. Called only for steps with prompt rows."""
        ...


def check_logits_shape(logits: Logits, num_rows: int) -> Optional[str]:
    """A message if ``logits`` is not ``[num_rows, vocab]`` (a runner that failed its step)."""
    shape = tuple(getattr(logits, "shape", ()))
    if len(shape) != 2 or shape[0] != num_rows:
        return f"the runner returned logits of shape {shape}; expected ({num_rows}, vocab)"
    return None


@runtime_checkable
class KVTierAgent(Protocol):
    """Moves the bytes of the lower KV tiers (host memory, disk) for the scheduler's plans."""

    def before_step(self, transfers: Optional[KVTransfers]) -> None:
        """Run the step's copies between the pool and the host tier; start its disk reads.
        Raises when a copy fails (the engine then fails the step)."""
        ...

    def save(self, ops: Sequence[DiskOp]) -> None:
        """Snapshot the blocks of ``ops`` now and write them to disk in the background."""
        ...

    def poll(self) -> tuple[list[tuple[BlockHash, bool]], list[BlockHash]]:
        """(finished disk reads ``(hash, ok)``, hashes whose disk writes failed) since the last call."""
        ...

    def wait(self, timeout_s: float) -> None:
        """Block up to ``timeout_s`` seconds for a disk read to finish."""
        ...

    def clear_disk(self, hashes: Sequence[BlockHash]) -> None:
        """Delete these blocks' files."""
        ...

    def close(self) -> None:
        """Finish queued writes and stop the I/O threads (idempotent)."""
        ...

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait up to ``timeout_s`` seconds for the queued disk I/O; True when it all finished."""
        ...

    def stats(self) -> dict:
        ...


@runtime_checkable
class KVEventPublisher(Protocol):
    """Sends the scheduler's KV cache events to subscribers (a router), best effort."""

    num_published: int
    num_dropped: int

    def publish(self, events: list[KVCacheEvent]) -> None:
        """Queue one batch; never blocks the step (a full queue drops and counts it)."""
        ...

    def close(self) -> None:
        ...
