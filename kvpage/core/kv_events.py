"""KV cache events for routers, in vLLM's schema, and the log the core writes them to.

Every change of what a tier holds is one event, in the order it happened:

    BlockStored(block_hashes, parent_block_hash, token_ids, block_size, medium)
        consecutive full blocks of one chain entered ``medium``; the parent hash is that of
        the block before the first one (None at the start of a chain, and for disk entries
        found at start-up, whose tokens are not kept);
    BlockRemoved(block_hashes, medium)
        the blocks left ``medium``;
    AllBlocksCleared()
        every tier was emptied.

Mediums follow vLLM: ``"GPU"`` is the engine's own block pool (on a CPU device too, as in
vLLM's CPU build), ``"CPU"`` the host tier, ``"DISK"`` the disk tier. Hashes here are the
32-byte ``BlockHash``; the publisher (``kvpage.engine.kv_events_publisher``) turns them into
64-bit ints and batches one step's events into a ``KVEventBatch``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any, Optional, Union

from kvpage.core.block_hash import BlockHash

MEDIUM_POOL = "GPU"
MEDIUM_HOST = "CPU"
MEDIUM_DISK = "DISK"


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: Optional[BlockHash]
    token_ids: tuple[int, ...]
    block_size: int
    medium: str
    lora_id: Optional[int] = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[BlockHash, ...]
    medium: str


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVCacheEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class KVEventLog:
    """Events since the last ``take``; a disabled log records nothing (and costs nothing)."""

    def __init__(self, enabled: bool = False) -> None:
        self.enabled = enabled
        self._events: list[KVCacheEvent] = []

    def stored(self, hashes, parent: Optional[BlockHash], token_ids, block_size: int, medium: str) -> None:
        if self.enabled and hashes:
            self._events.append(BlockStored(tuple(hashes), parent, tuple(token_ids), block_size, medium))

    def removed(self, hashes, medium: str) -> None:
        if self.enabled and hashes:
            self._events.append(BlockRemoved(tuple(hashes), medium))

    def cleared(self) -> None:
        if self.enabled:
            self._events.append(AllBlocksCleared())

    def take(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """vLLM's ``--kv-events-config``: whether and where to publish KV events.

    Attributes:
        enable_kv_cache_events: record and publish events.
        publisher: ``"zmq"`` (ZeroMQ PUB) or ``"null"``; default ``"zmq"`` when enabled.
        endpoint: PUB address; ``*`` binds (``tcp://*:5557``), a host connects.
        replay_endpoint: optional ROUTER address that replays past batches on request.
        buffer_steps: batches kept for replay.
        hwm: ZeroMQ high-water mark of the PUB socket (messages).
        max_queue_size: batches queued for the publisher thread before new ones are dropped.
        topic: the first frame of every message.
    """

    enable_kv_cache_events: bool = False
    publisher: Optional[str] = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: Optional[str] = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError(f"kv_events_config.enable_kv_cache_events must be a boolean, got "
                             f"{self.enable_kv_cache_events!r}")
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        if self.publisher not in ("zmq", "null"):
            raise ValueError(f"kv_events_config.publisher must be 'zmq' or 'null', got {self.publisher!r}")
        for name in ("endpoint", "topic"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"kv_events_config.{name} must be a string, got {getattr(self, name)!r}")
        if self.replay_endpoint is not None and not isinstance(self.replay_endpoint, str):
            raise ValueError(f"kv_events_config.replay_endpoint must be a string, got {self.replay_endpoint!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"kv_events_config.{name} must be a positive integer, got {value!r}")

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def parse(cls, value: Any) -> Optional["KVEventsConfig"]:
        """A config from a ``KVEventsConfig``, a dict or a JSON object string (None stays None).

        Raises ``ValueError`` naming the problem (bad JSON, an unknown key, a bad value).
        """
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"kv_events_config is not valid JSON: {exc.msg} (at character {exc.pos})") from None
        if not isinstance(value, dict):
            raise ValueError(f"kv_events_config must be a JSON object, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"kv_events_config: unknown key(s) {unknown}; expected {sorted(known)}")
        return cls(**value)
