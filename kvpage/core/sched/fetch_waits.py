"""Requests waiting for their prefix to be read from the disk tier.

A request whose prefix hit continues on disk leaves the waiting queue while the blocks are
read into host memory in the background; it holds no pool blocks meanwhile, so waiting
costs the pool nothing. It goes back to the head of the queue when every block it waits
for has been read (or has failed), or after ``timeout_s`` whatever happened, so a read
that never reports cannot hold a request forever. Each request waits at most once
(``Request.kv_fetch_waited``): afterwards it takes what the host tier has.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator

from kvpage.core.block_hash import BlockHash
from kvpage.core.request import Request

#: Seconds a request waits for disk reads at most.
FETCH_TIMEOUT_S = 30.0


@dataclass(slots=True)
class _Wait:
    request: Request
    hashes: set
    deadline: float


class FetchWaits:
    """Parked requests by id, each with the block hashes it still waits for."""

    def __init__(self, timeout_s: float = FETCH_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self._waits: dict[str, _Wait] = {}

    def __len__(self) -> int:
        return len(self._waits)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._waits

    def __iter__(self) -> Iterator[Request]:
        return (w.request for w in self._waits.values())

    def park(self, request: Request, hashes: Iterable[BlockHash], now: float) -> None:
        request.kv_fetch_waited = True
        self._waits[request.request_id] = _Wait(request, set(hashes), now + self.timeout_s)

    def discard(self, request_id: str) -> None:
        self._waits.pop(request_id, None)

    def resolve(self, hashes: Iterable[BlockHash], now: float) -> list[Request]:
        """Mark ``hashes`` read (or failed); return the requests released, earliest first
        (released: nothing left to wait for, or past their deadline)."""
        done = set(hashes)
        released = []
        for request_id, wait in list(self._waits.items()):
            wait.hashes -= done
            if not wait.hashes or now >= wait.deadline:
                released.append(wait.request)
                del self._waits[request_id]
        return sorted(released, key=lambda r: r.sort_key)
