"""WaitingQueue: FCFS and priority order, push_front for preempted requests, lazy discard."""
from __future__ import annotations

import pytest

from kvpage import Request, RequestStatus, SamplingParams
from kvpage.core.sched.waiting_queue import WaitingQueue


def req(request_id: str, arrival_order: int, priority: int = 0) -> Request:
    r = Request(request_id, [1, 2, 3], SamplingParams(priority=priority))
    r.arrival_order = arrival_order  # the scheduler sets it; the queue only reads it
    return r


def ids(queue: WaitingQueue) -> list[str]:
    return [r.request_id for r in queue]


def drain(queue: WaitingQueue) -> list[str]:
    out = []
    while len(queue):
        out.append(queue.pop().request_id)
    return out


def test_fcfs_pops_in_arrival_order():
    q = WaitingQueue()
    for i, name in enumerate(["a", "b", "c", "d"]):
        q.push(req(name, i))
    assert len(q) == 4
    assert q.peek().request_id == "a"
    assert ids(q) == ["a", "b", "c", "d"]
    assert drain(q) == ["a", "b", "c", "d"]
    assert len(q) == 0 and q.peek() is None


def test_fcfs_ignores_priority():
    q = WaitingQueue("fcfs")
    q.push(req("late-urgent", 1, priority=-5))
    q.push(req("early", 0, priority=9))
    assert drain(q) == ["late-urgent", "early"]


def test_fcfs_push_front_puts_a_preempted_request_first():
    q = WaitingQueue()
    a, b, c = req("a", 0), req("b", 1), req("c", 2)
    q.push(a)
    q.push(b)
    assert q.pop() is a
    q.push(c)
    q.push_front(a)  # a was preempted: it goes back ahead of everyone
    assert len(q) == 3
    assert ids(q) == ["a", "b", "c"]
    assert drain(q) == ["a", "b", "c"]


def test_priority_orders_by_priority_then_arrival_order():
    q = WaitingQueue("priority")
    q.push(req("p5-first", 0, priority=5))
    q.push(req("p1-second", 1, priority=1))
    q.push(req("p5-third", 2, priority=5))
    q.push(req("p1-fourth", 3, priority=1))
    q.push(req("neg", 4, priority=-1))
    assert q.peek().request_id == "neg"
    assert ids(q) == ["neg", "p1-second", "p1-fourth", "p5-first", "p5-third"]
    assert drain(q) == ["neg", "p1-second", "p1-fourth", "p5-first", "p5-third"]


def test_priority_ties_break_by_arrival_order_not_push_order():
    q = WaitingQueue("priority")
    q.push(req("arrived-2", 2))
    q.push(req("arrived-0", 0))
    q.push(req("arrived-1", 1))
    assert drain(q) == ["arrived-0", "arrived-1", "arrived-2"]


def test_priority_push_front_keeps_the_requests_own_rank():
    q = WaitingQueue("priority")
    old = req("old", 0, priority=3)
    q.push(old)
    assert q.pop() is old
    q.push(req("urgent", 5, priority=0))
    q.push(req("newer-same-priority", 6, priority=3))
    q.push_front(old)  # preempted: its (priority, arrival_order) key still ranks it
    assert ids(q) == ["urgent", "old", "newer-same-priority"]
    assert drain(q) == ["urgent", "old", "newer-same-priority"]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_discard_is_lazy_but_len_and_peek_are_exact(policy):
    q = WaitingQueue(policy)
    reqs = [req(name, i) for i, name in enumerate(["a", "b", "c", "d"])]
    for r in reqs:
        q.push(r)
    q.discard("a")
    q.discard("c")
    assert len(q) == 2
    assert "a" not in q and "c" not in q and "b" in q and "d" in q
    assert q.peek().request_id == "b"  # the discarded head is skipped
    assert ids(q) == ["b", "d"]
    assert q.pop().request_id == "b"
    assert len(q) == 1
    assert q.peek().request_id == "d"  # "c" skipped on the way
    q.discard("d")
    assert len(q) == 0 and q.peek() is None
    q.discard("never-queued")  # discarding an unknown id is a no-op
    assert len(q) == 0


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_pop_on_empty_raises_index_error(policy):
    q = WaitingQueue(policy)
    with pytest.raises(IndexError, match="pop from an empty waiting queue"):
        q.pop()
    q.push(req("a", 0))
    q.discard("a")
    with pytest.raises(IndexError, match="pop from an empty waiting queue"):
        q.pop()


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_requests_no_longer_waiting_are_skipped(policy):
    q = WaitingQueue(policy)
    a, b = req("a", 0), req("b", 1)
    q.push(a)
    q.push(b)
    a.status = RequestStatus.RUNNING  # e.g. admitted through another path
    assert ids(q) == ["b"]
    assert q.peek() is b


def test_pop_removes_from_membership():
    q = WaitingQueue()
    q.push(req("a", 0))
    assert "a" in q
    q.pop()
    assert "a" not in q and len(q) == 0


def test_iteration_does_not_consume():
    q = WaitingQueue("priority")
    for i, p in enumerate([2, 0, 1]):
        q.push(req(f"r{i}", i, priority=p))
    assert ids(q) == ["r1", "r2", "r0"]
    assert ids(q) == ["r1", "r2", "r0"]
    assert len(q) == 3
