"""A request's lifecycle state as the scheduler sees it.

Token index regions of one request (``all_token_ids`` = prompt + output)::

    [0, num_cached_tokens)            KV served from the prefix cache at admission
    [0, num_computed_tokens)          KV already in the paged cache
    [num_computed_tokens, num_tokens) tokens still to feed to the model
"""
from __future__ import annotations

import enum
import numbers
import operator
import time
from collections.abc import Sized
from typing import Hashable, Optional, Sequence

from kvpage.core.block_hash import BlockHash, chain_hashes, namespace_root
from kvpage.core.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    """Why a request ended; the string values match OpenAI's ``finish_reason``."""

    LENGTH = "length"  # max_tokens or max_model_len reached
    STOP = "stop"  # EOS, a stop token id or a stop string
    ABORT = "abort"
    ERROR = "error"


#: The largest token id: step metadata carries token ids as int64.
MAX_TOKEN_ID = 2**63 - 1


def sample_request_id(group_id: str, index: int, num_samples: int) -> str:
    """The scheduler id of sample ``index`` of user request ``group_id`` (``n`` samples)."""
    return group_id if num_samples == 1 else f"{group_id}#{index}"


def as_token_ids(values: Sequence) -> list[int]:
    """``values`` as a list of ints: integers (numpy's too, through ``operator.index``).
    Raises ``TypeError`` for anything else, bools (ints to Python, not tokens) included."""
    ids = list(map(operator.index, values))  # TypeError for floats, strings, None
    if bool in set(map(type, values)):
        raise TypeError("bools are not token ids")
    return ids


class Request:
    """One sequence being generated.

    ``namespace`` keeps prefix-cache entries apart (a cache salt or an adapter id):
    requests only share cached blocks with requests of the same namespace.
    ``group_id`` and ``sample_index`` name the user request this sequence is a sample of
    (``n > 1`` forks one sequence per sample); ``arrival_order`` is set by the scheduler.
    """

    __slots__ = (
        "request_id", "sampling_params", "eos_token_id", "namespace", "arrival_time",
        "arrival_order", "all_token_ids", "num_prompt_tokens", "status", "block_tables", "released_blocks",
        "num_computed_tokens", "num_cached_tokens", "num_inserted_blocks", "num_preemptions",
        "finish_reason", "error", "first_token_time", "finish_time", "last_token_time",
        "prefix_queried", "group_id", "sample_index", "pending_block_copies", "block_hashes",
        "kv_fetch_waited", "state_slot",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: Optional[SamplingParams] = None,
        eos_token_id: Optional[int] = None,
        namespace: Hashable = None,
        arrival_time: Optional[float] = None,
        group_id: Optional[str] = None,
        sample_index: int = 0,
    ) -> None:
        if not isinstance(request_id, str):
            raise ValueError(f"a request id is a string, got {type(request_id).__name__} {request_id!r}")
        if isinstance(prompt_token_ids, (str, bytes)) or not isinstance(prompt_token_ids, Sized):
            raise ValueError(f"request {request_id!r}: prompt_token_ids must be a sequence of token ids, "
                             f"got {type(prompt_token_ids).__name__}")
        if len(prompt_token_ids) == 0:
            raise ValueError(f"request {request_id!r}: the prompt is empty")
        if sampling_params is not None and not isinstance(sampling_params, SamplingParams):
            raise ValueError(f"request {request_id!r}: sampling_params must be a SamplingParams, "
                             f"got {type(sampling_params).__name__}")
        if eos_token_id is not None and (isinstance(eos_token_id, bool) or not isinstance(eos_token_id, numbers.Integral)
                                         or not 0 <= eos_token_id <= MAX_TOKEN_ID):
            raise ValueError(f"request {request_id!r}: eos_token_id must be None or a token id, got {eos_token_id!r}")
        try:
            hash(namespace)
        except TypeError:
            raise ValueError(f"request {request_id!r}: namespace must be hashable (a string, say), "
                             f"got {type(namespace).__name__}") from None
        self.request_id = request_id
        self.sampling_params = sampling_params or SamplingParams()
        self.eos_token_id = eos_token_id
        self.namespace = namespace
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.arrival_order = 0
        self.group_id = request_id if group_id is None else group_id
        self.sample_index = sample_index
        try:
            self.all_token_ids: list[int] = as_token_ids(prompt_token_ids)
        except TypeError:
            raise ValueError(f"request {request_id!r}: token ids are integers, not "
                             f"{sorted({type(t).__name__ for t in prompt_token_ids})}") from None
        lowest, highest = min(self.all_token_ids), max(self.all_token_ids)
        if lowest < 0 or highest > MAX_TOKEN_ID:
            bad = lowest if lowest < 0 else highest
            raise ValueError(f"request {request_id!r}: token ids are non-negative integers below 2**63, got {bad}")
        self.num_prompt_tokens = len(self.all_token_ids)
        self.status = RequestStatus.WAITING
        # One block table per KV group (``kv_groups``); group 0's is ``block_ids``. In a
        # sliding-window group the first ``released_blocks[g]`` entries left the window and
        # went back to the pool: they are padding (0), never read, never freed again.
        self.block_tables: list[list[int]] = [[]]
        self.released_blocks: list[int] = [0]
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.num_inserted_blocks = 0  # leading full blocks already offered to the prefix cache
        self.num_preemptions = 0
        self.finish_reason: Optional[FinishReason] = None
        self.error: Optional[str] = None
        self.first_token_time: Optional[float] = None
        self.last_token_time: Optional[float] = None
        self.finish_time: Optional[float] = None
        self.prefix_queried = False  # the prefix-cache query was counted once
        # (src, dst) copy-on-write copies made for this request since it was last scheduled;
        # the scheduler moves them into the step's metadata.
        self.pending_block_copies: list[tuple[int, int]] = []
        self.block_hashes: list[BlockHash] = []  # of the leading full blocks, filled on demand
        self.kv_fetch_waited = False  # it waited once for blocks read from the disk tier
        # Its recurrent-state slot (``state_slots``; models with state-space layers), held
        # while it holds blocks.
        self.state_slot: Optional[int] = None

    @property
    def block_ids(self) -> list[int]:
        """Group 0's block table (the only one of a non-hybrid engine)."""
        return self.block_tables[0]

    @block_ids.setter
    def block_ids(self, blocks: list[int]) -> None:
        self.block_tables[0] = blocks

    def held_blocks(self, group: int) -> list[int]:
        """The blocks this request holds in ``group`` (its table without released padding)."""
        return self.block_tables[group][self.released_blocks[group]:]

    # Derived sizes, so callers never repeat the index arithmetic.
    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.all_token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_computed_tokens

    def full_block_hashes(self, num_blocks: int, block_size: int) -> list[BlockHash]:
        """Hashes of the first ``num_blocks`` full blocks (``block_hash``), computed once each.

        Tokens are only ever appended, so hashes computed earlier stay valid.
        """
        have = len(self.block_hashes)
        if have < num_blocks:
            parent = self.block_hashes[-1] if have else namespace_root(self.namespace)
            self.block_hashes += chain_hashes(parent, self.all_token_ids[have * block_size : num_blocks * block_size],
                                              block_size)
        return self.block_hashes[:num_blocks]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def sort_key(self) -> tuple:
        """Scheduling order: lower priority value first, then earlier arrival."""
        return (self.sampling_params.priority, self.arrival_order)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={len(self.block_ids)})"
        )
