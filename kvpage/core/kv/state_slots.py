"""Slots for per-request recurrent state, beside the paged KV.

A model with state-space, gated-delta-net, short-convolution or other linear-attention
layers carries a fixed-size state per sequence (its convolution window and its recurrent
state) instead of KV that grows with the context. The runner keeps those states in slot
tensors ``[num_slots, ...]`` per layer; this pool hands the slot numbers out. A request
takes a slot when it is first given KV blocks and gives it back when it frees them
(finished, aborted or preempted: recomputation starts from a zero state). A forked sample
takes a slot of its own, filled from its parent's before its first step
(``Request.pending_state_copy``).

Invariant: ``num_free + num_used == num_slots``, and no slot is held twice.
"""
from __future__ import annotations

from typing import Optional


class StateSlotPool:
    """A fixed pool of ``num_slots`` recurrent-state slots (numbers ``0 .. num_slots - 1``)."""

    def __init__(self, num_slots: int) -> None:
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots <= 0:
            raise ValueError(f"num_state_slots must be a positive integer, got {num_slots!r}")
        self.num_slots = num_slots
        # Low numbers first: a lightly loaded engine touches few slot rows.
        self._free = list(range(num_slots - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def allocate(self) -> Optional[int]:
        """A free slot, or None when every slot is held."""
        if not self._free:
            return None
        slot = self._free.pop()
        self._used.add(slot)
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._used:
            raise ValueError(f"state slot {slot} is not held")
        self._used.remove(slot)
        self._free.append(slot)

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` if the free and used sets overlap or miss a slot."""
        free = set(self._free)
        assert len(free) == len(self._free), "a state slot is free twice"
        assert not free & self._used, "a state slot is both free and used"
        assert free | self._used == set(range(self.num_slots)), "a state slot is lost"
