"""Publishes the engine's KV events over ZeroMQ, in vLLM's schema and wire format.

Each step's events (``kvpage.core.kv_events``) go out as one ``KVEventBatch`` (``ts``
in seconds since the epoch, ``events``), msgpack-encoded by msgspec with the event type
as a tag, in a three-frame message ``[topic, sequence number (8 bytes big-endian),
payload]``, as vLLM's ``ZmqEventPublisher`` sends them. Block hashes are 64-bit ints
(``block_hash.external_hash``). With a ``replay_endpoint`` a ROUTER socket answers a
request ``[b"", start sequence (8 bytes)]`` with every buffered batch from there on,
``[b"", seq, payload]`` each, then ``[b"", -1 (8 bytes), b""]``.

Endpoints follow vLLM's convention: an address with ``*`` (or ``::``, ``ipc://``,
``inproc://``) is bound, any other is connected to. Sockets live on the publisher thread
only; ``publish`` just queues (and drops, counting, when the queue is full), so a slow or
absent subscriber never stalls the engine.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Optional, Sequence, Union

import msgspec

from kvpage.core import kv_events as core_events
from kvpage.core.block_hash import external_hash
from kvpage.core.kv_events import KVEventsConfig

log = logging.getLogger("kvpage")

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the wire events (tagged with the class name, as vLLM's)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str] = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: Optional[str]


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]
    data_parallel_rank: Optional[int] = None


def to_wire(event: core_events.KVCacheEvent) -> KVCacheEvent:
    """The wire form of one core event (32-byte hashes become 64-bit ints)."""
    if isinstance(event, core_events.BlockStored):
        parent = None if event.parent_block_hash is None else external_hash(event.parent_block_hash)
        return BlockStored([external_hash(h) for h in event.block_hashes], parent, list(event.token_ids),
                           event.block_size, event.lora_id, event.medium)
    if isinstance(event, core_events.BlockRemoved):
        return BlockRemoved([external_hash(h) for h in event.block_hashes], event.medium)
    return AllBlocksCleared()


def decode_batch(payload: bytes) -> KVEventBatch:
    """Decode one published payload (for subscribers and tests)."""
    return msgspec.msgpack.decode(payload, type=KVEventBatch)


def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    """A PUB socket (and optional replay ROUTER) fed from a queue by one daemon thread."""

    def __init__(self, config: KVEventsConfig) -> None:
        import zmq

        self.config = config
        self.num_dropped = 0
        self.num_published = 0
        self._queue: "queue.Queue[Optional[KVEventBatch]]" = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode("utf-8")
        self._context = zmq.Context.instance()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        (self._pub.bind if _binds(config.endpoint) else self._pub.connect)(config.endpoint)
        self._replay = None
        if config.replay_endpoint:
            self._replay = self._context.socket(zmq.ROUTER)
            self._replay.bind(config.replay_endpoint)
        self._thread = threading.Thread(target=self._run, name="kvpage-kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list) -> None:
        """Queue one batch of core events (never blocks; a full queue drops the batch)."""
        batch = KVEventBatch(ts=time.time(), events=[to_wire(e) for e in events])
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.num_dropped += 1

    def close(self, timeout_s: float = 2.0) -> None:
        """Send what is queued (up to ``timeout_s``), then close the sockets. Idempotent."""
        if self._thread is None:
            return
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            pass
        self._thread.join(timeout_s)
        self._thread = None

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        seq = 0
        try:
            while True:
                self._serve_replay()
                try:
                    batch = self._queue.get(timeout=0.05)
                except queue.Empty:
                    continue
                if batch is None:
                    break
                payload = encoder.encode(batch)
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
                seq += 1
                self.num_published += 1
        except Exception:  # noqa: BLE001 - events are best effort; the engine must not notice
            log.exception("KV event publisher stopped")
        finally:
            self._pub.close(linger=500)
            if self._replay is not None:
                self._replay.close(linger=0)

    def _serve_replay(self) -> None:
        if self._replay is None or not self._replay.poll(0):
            return
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            return
        identity, start = frames[0], int.from_bytes(frames[2], "big")
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart((identity, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((identity, b"", END_SEQ, b""))


def open_publisher(events_config: Optional[KVEventsConfig],
                   restored: Sequence[core_events.KVCacheEvent] = ()) -> Optional[ZmqEventPublisher]:
    """A started publisher for ``events_config`` (None unless it publishes).

    Its first batch says ``AllBlocksCleared`` (whatever a router knew of an earlier run is
    gone), then ``restored``: the events of what the disk tier brought back.
    """
    if events_config is None or not events_config.publishes:
        return None
    publisher = ZmqEventPublisher(events_config)
    publisher.publish([core_events.AllBlocksCleared(), *restored])
    return publisher
