"""Requests waiting for admission, in scheduling order.

FCFS keeps arrival order in a deque; the priority policy keeps a heap on
``Request.sort_key``. Removal of an aborted request is lazy (skipped when it reaches
the head), so abort is O(1) and the live count stays exact.
"""
from __future__ import annotations

import heapq
from collections import deque
from typing import Iterator, Optional

from kvpage.core.request import Request, RequestStatus


class WaitingQueue:
    def __init__(self, policy: str = "fcfs") -> None:
        self.policy = policy
        self._fifo: deque[Request] = deque()
        self._heap: list[tuple[tuple, Request]] = []
        self._live: set[str] = set()

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._live

    def push(self, request: Request) -> None:
        """Queue a new request behind the others."""
        self._live.add(request.request_id)
        if self.policy == "priority":
            heapq.heappush(self._heap, (request.sort_key, request))
        else:
            self._fifo.append(request)

    def push_front(self, request: Request) -> None:
        """Queue a preempted request ahead of the others (it keeps its place in line)."""
        self._live.add(request.request_id)
        if self.policy == "priority":
            heapq.heappush(self._heap, (request.sort_key, request))  # its old key already ranks it
        else:
            self._fifo.appendleft(request)

    def discard(self, request_id: str) -> None:
        self._live.discard(request_id)

    def _drop_dead_head(self) -> None:
        if self.policy == "priority":
            while self._heap and not self._is_live(self._heap[0][1]):
                heapq.heappop(self._heap)
        else:
            while self._fifo and not self._is_live(self._fifo[0]):
                self._fifo.popleft()

    def _is_live(self, request: Request) -> bool:
        return request.request_id in self._live and request.status is RequestStatus.WAITING

    def peek(self) -> Optional[Request]:
        self._drop_dead_head()
        if self.policy == "priority":
            return self._heap[0][1] if self._heap else None
        return self._fifo[0] if self._fifo else None

    def pop(self) -> Request:
        request = self.peek()
        if request is None:
            raise IndexError("pop from an empty waiting queue")
        if self.policy == "priority":
            heapq.heappop(self._heap)
        else:
            self._fifo.popleft()
        self._live.discard(request.request_id)
        return request

    def __iter__(self) -> Iterator[Request]:
        items = (r for _, r in sorted(self._heap, key=lambda e: e[0])) if self.policy == "priority" else iter(self._fifo)
        return (r for r in items if self._is_live(r))
