"""``KVTierAgent``: performs the KV copies the core plans, between the pool and the tiers.

It owns the host tier's memory (``HostKVBuffers``) and the disk tier's files
(``DiskKVStore``) and holds the pool's buffers; the engine hands it each step's plan:

* ``before_step(transfers)``: host stores, then host loads, synchronously (memory copies,
  ordered before the forward that may overwrite the stored blocks); disk reads are queued.
* ``save(ops)``: after a successful step, snapshot the blocks to save (so later steps may
  reuse them) and queue the writes and removals, in order.
* ``poll()``: completed disk reads ``(hash, ok)`` and failed writes, for the scheduler.

Disk I/O runs on two daemon threads, one for reads (a request waits on them) and one for
writes and deletions, so a backlog of writes never delays a read. The writer runs at the
lowest CPU priority: on a machine with few cores, write-through must not steal time from
the model's compute threads (which wait for each other at every parallel region). A read of a block whose
write is still queued is served from the write's snapshot. A disk that is full, read-only
or returns corrupt data never fails a request: the read or write is reported as failed,
the block is recomputed, a warning is logged (at most once a minute per kind) and
``kv_disk_errors_<kind>`` counts it. Nothing in the pool or host tier is touched by a
disk error.
"""
from __future__ import annotations

import errno
import logging
import os
import queue
import threading
import time
from typing import Any, Optional, Sequence

from kvpage.core.block_hash import BlockHash
from kvpage.core.offload.kv_transfers import DiskOp, KVTransfers
from kvpage.storage.paged_cache import PagedKVCache

from kvpage.storage.tiers.disk_store import CorruptEntry, DiskKVStore
from kvpage.storage.tiers.histogram import LatencyHistogram
from kvpage.storage.tiers.host_buffers import HostKVBuffers

log = logging.getLogger("kvpage")

#: Snapshots waiting to be written are capped at this many bytes; past it a save is
#: dropped (and reported failed) rather than letting memory grow behind a slow disk.
MAX_PENDING_WRITE_BYTES = 256 << 20
_WARN_INTERVAL_S = 60.0
ERROR_KINDS = ("corrupt", "missing", "full", "read_only", "io", "dropped")
_FULL = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC), errno.EFBIG}
_READ_ONLY = {errno.EROFS, errno.EACCES, errno.EPERM}


def _lowest_cpu_priority() -> None:
    """Run the calling thread at nice 19 (Linux: a thread's own priority), so write-through
    yields the CPU to the model's compute threads; a no-op where that is not possible."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        pass


def classify_os_error(exc: OSError) -> str:
    """``"full"``, ``"read_only"`` or ``"io"`` for a failed disk write."""
    if exc.errno in _FULL:
        return "full"
    if exc.errno in _READ_ONLY:
        return "read_only"
    return "io"


class KVTierAgent:
    """Copies for a ``KVOffloadManager``'s plans over ``kv_cache``; see the module doc."""

    def __init__(self, kv_cache: PagedKVCache, num_host_slots: int, disk: Optional[DiskKVStore] = None,
                 disk_writable: bool = False) -> None:
        self.host = HostKVBuffers(kv_cache, num_host_slots)
        self.disk = disk
        self.disk_writable = disk_writable
        self.bytes_per_block = kv_cache.spec.bytes_per_block
        self.bytes = dict.fromkeys(("host_stored", "host_loaded", "disk_written", "disk_read"), 0)
        self.errors = dict.fromkeys(ERROR_KINDS, 0)
        self.latency = {name: LatencyHistogram() for name in ("host_store", "host_load", "disk_store", "disk_load")}
        self._done: "queue.Queue[tuple]" = queue.Queue()
        self._reads: "queue.Queue[Optional[tuple]]" = queue.Queue()
        self._writes: "queue.Queue[Optional[tuple]]" = queue.Queue()
        self._lock = threading.RLock()  # guards the pending writes and the error counters
        self._pending_writes: dict[BlockHash, tuple] = {}  # hash -> (key, value) snapshot not yet on disk
        self._pending_bytes = 0
        self._last_warning: dict[str, float] = {}
        self._threads: list[threading.Thread] = []
        self._closed = False
        if disk is not None:
            for target, name in ((self._read_loop, "kvpage-disk-reads"), (self._write_loop, "kvpage-disk-writes")):
                thread = threading.Thread(target=target, name=name, daemon=True)
                thread.start()
                self._threads.append(thread)

    # ------------------------------------------------------------------ the engine's calls
    def before_step(self, transfers: Optional[KVTransfers]) -> None:
        """Queue the step's disk reads, then copy its host stores and loads (in that order)."""
        if transfers is None:
            return
        for block_hash, slot in transfers.disk_fetches:  # first: queuing cannot fail
            if self._closed:  # nobody would read it: report it failed so no request waits
                self._done.put(("fetch", block_hash, False))
            else:
                self._reads.put((block_hash, slot))
        if len(transfers.host_stores):
            start = time.perf_counter()
            self.host.store(transfers.host_stores)
            self.latency["host_store"].observe(time.perf_counter() - start)
            self.bytes["host_stored"] += len(transfers.host_stores) * self.bytes_per_block
        if len(transfers.host_loads):
            start = time.perf_counter()
            self.host.load(transfers.host_loads)
            self.latency["host_load"].observe(time.perf_counter() - start)
            self.bytes["host_loaded"] += len(transfers.host_loads) * self.bytes_per_block

    def save(self, ops: Sequence[DiskOp]) -> None:
        """Snapshot the blocks of ``ops``' saves now; write and remove in the background, in order."""
        if not ops or self.disk is None:
            return
        if self._closed:
            for op in ops:
                if op.kind == "save":
                    self._done.put(("save_failed", op.block_hash, False))
            return
        saves = [op for op in ops if op.kind == "save"]
        keys = values = None
        if saves:
            keys, values = self.host.gather_pool([op.block_id for op in saves])
        index = 0
        for op in ops:
            if op.kind != "save":
                self._writes.put(("remove", op.block_hash, None, None))
                continue
            key, value = keys[index], values[index]
            index += 1
            with self._lock:
                if self._pending_bytes + self.bytes_per_block > MAX_PENDING_WRITE_BYTES:
                    self._fail_save(op.block_hash, "dropped", "the disk is falling behind; a block was not saved")
                    continue
                self._pending_writes[op.block_hash] = (key, value)
                self._pending_bytes += self.bytes_per_block
            self._writes.put(("save", op.block_hash, key, value))

    def poll(self) -> tuple[list[tuple[BlockHash, bool]], list[BlockHash]]:
        """(finished disk reads as (hash, ok), hashes whose write failed) since the last call."""
        fetched, failed = [], []
        while True:
            try:
                kind, block_hash, ok = self._done.get_nowait()
            except queue.Empty:
                return fetched, failed
            (fetched.append((block_hash, ok)) if kind == "fetch" else failed.append(block_hash))

    def wait(self, timeout_s: float) -> None:
        """Block until a disk read or write reports, or ``timeout_s`` passes (the item stays queued)."""
        try:
            item = self._done.get(timeout=timeout_s)
        except queue.Empty:
            return
        self._done.put(item)

    def clear_disk(self, hashes: Sequence[BlockHash]) -> None:
        """Delete the files of ``hashes`` (after the core forgot them), in the background."""
        for block_hash in hashes:
            self._writes.put(("remove", block_hash, None, None))

    def close(self, timeout_s: float = 30.0) -> None:
        """Finish the queued writes (up to ``timeout_s``) and stop the threads. Idempotent."""
        if self._closed:
            return
        self._closed = True
        threads, self._threads = self._threads, []
        for q in (self._writes, self._reads):
            q.put(None)
        deadline = time.monotonic() + timeout_s
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def note_unwritable(self, message: str) -> None:
        """The disk folder could not be written at start-up: count it and warn."""
        self._error("read_only", message, "it serves the blocks it holds and saves none")

    def stats(self) -> dict:
        stats = {f"kv_{name}_bytes": value for name, value in self.bytes.items()}
        stats["kv_disk_writable"] = int(self.disk is not None and self.disk_writable)
        stats.update({f"kv_disk_errors_{kind}": count for kind, count in self.errors.items()})
        stats["kv_host_tier_bytes"] = self.host.nbytes
        stats["kv_disk_pending_writes"] = len(self._pending_writes)
        stats["kv_tier_latency"] = {name: h.snapshot() for name, h in self.latency.items()}
        return stats

    # ------------------------------------------------------------------ background threads
    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued disk read and write is done; False if ``timeout_s`` passed."""
        deadline = time.monotonic() + timeout_s
        for q in (self._reads, self._writes):
            while q.unfinished_tasks and time.monotonic() < deadline:
                time.sleep(0.001)
        return not (self._reads.unfinished_tasks or self._writes.unfinished_tasks)

    def _read_loop(self) -> None:
        while (item := self._reads.get()) is not None:
            block_hash, slot = item
            self._done.put(("fetch", block_hash, self._read_one(block_hash, slot)))
            self._reads.task_done()
        self._reads.task_done()
        self._drain_reads()

    def _drain_reads(self) -> None:
        """After close: report every read still queued as failed, so no request waits on it."""
        while True:
            try:
                item = self._reads.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                self._done.put(("fetch", item[0], False))
            self._reads.task_done()

    def _read_one(self, block_hash: BlockHash, slot: int) -> bool:
        start = time.perf_counter()
        try:
            with self._lock:
                pending = self._pending_writes.get(block_hash)
            if pending is not None:
                key, value = pending
            else:
                key, value, size = self.disk.read(block_hash)
                self.bytes["disk_read"] += size
            self.host.write_slot(slot, key, value)
        except CorruptEntry as exc:
            self._error("corrupt", f"dropped corrupt block file {self.disk.path(block_hash).name} ({exc})")
            self._remove_quietly(block_hash)
            return False
        except FileNotFoundError:
            self._error("missing", f"block file {self.disk.path(block_hash).name} is gone")
            return False
        except Exception as exc:  # noqa: BLE001 - any read failure means: recompute
            self._error("io", f"cannot read {self.disk.path(block_hash).name}: {type(exc).__name__}: {exc}")
            return False
        self.latency["disk_load"].observe(time.perf_counter() - start)
        return True

    def _write_loop(self) -> None:
        _lowest_cpu_priority()
        while (item := self._writes.get()) is not None:
            try:
                self._write_one(*item)
            finally:
                self._writes.task_done()
        self._writes.task_done()

    def _write_one(self, kind: str, block_hash: BlockHash, key: Any, value: Any) -> None:
        if kind == "remove":
            self._remove_quietly(block_hash)
            return
        start = time.perf_counter()
        try:
            if not self.disk_writable:
                raise OSError(errno.EROFS, "the disk tier was opened read-only")
            self.bytes["disk_written"] += self.disk.write(block_hash, key, value)
            self.latency["disk_store"].observe(time.perf_counter() - start)
        except Exception as exc:  # noqa: BLE001 - a failed write means: that block is not on disk
            kind = classify_os_error(exc) if isinstance(exc, OSError) else "io"
            self._fail_save(block_hash, kind, f"cannot write a block file: {exc}")
        finally:
            with self._lock:
                pending = self._pending_writes.get(block_hash)
                if pending is not None and pending[0] is key:  # not a later save of the same block
                    del self._pending_writes[block_hash]
                self._pending_bytes -= self.bytes_per_block

    def _fail_save(self, block_hash: BlockHash, kind: str, message: str) -> None:
        self._error(kind, message)
        self._done.put(("save_failed", block_hash, False))

    def _remove_quietly(self, block_hash: BlockHash) -> None:
        if not self.disk_writable:
            return
        try:
            self.disk.remove(block_hash)
        except OSError as exc:
            self._error(classify_os_error(exc), f"cannot delete a block file: {exc}")

    def _error(self, kind: str, message: str, consequence: str = "recomputing instead") -> None:
        with self._lock:
            self.errors[kind] += 1
            count = self.errors[kind]
            now = time.monotonic()
            warn = now - self._last_warning.get(kind, -_WARN_INTERVAL_S) >= _WARN_INTERVAL_S
            if warn:
                self._last_warning[kind] = now
        if warn:
            log.warning("disk KV cache: %s; %s (kv_disk_errors_%s = %d)", message, consequence, kind, count)
