"""The engine's side of the lower KV tiers: when, within a step, the tier agent moves bytes.

``TierSteps`` pairs a ``KVTierAgent`` (the bytes) with the scheduler's ``TierScheduling``
(the bookkeeping) and is called by ``LLMEngine.step`` at fixed points:

    report_results()      before ``schedule``: finished disk reads and failed writes
    copy_in(output)       before the forward: the step's pool <-> host copies, disk reads
    discard(output)       the copies raised: forget them (no request read them)
    save(output)          after a successful step: snapshot the disk writes it needs,
                          before the next schedule can reuse the blocks
    idle(output)          a step that scheduled nothing: start parked requests' disk reads

Torch-free.
"""
from __future__ import annotations

from typing import Sequence

from kvpage.core.block_hash import BlockHash
from kvpage.core.sched.output import SchedulerOutput
from kvpage.core.sched.tier_scheduling import TierScheduling
from kvpage.engine.interfaces import KVTierAgent

#: Seconds an idle step waits for a disk read when only disk reads can make progress.
IDLE_WAIT_S = 0.05


class TierSteps:
    def __init__(self, agent: KVTierAgent, plan: TierScheduling) -> None:
        self.agent = agent
        self.plan = plan

    def report_results(self) -> None:
        fetched, failed_saves = self.agent.poll()
        self.plan.complete_saves(failed_saves)
        self.plan.complete_fetches(fetched)  # also times out requests waiting too long

    def copy_in(self, output: SchedulerOutput) -> None:
        """The step's tier copies; raises when one fails."""
        self.agent.before_step(output.kv_transfers)

    def discard(self, output: SchedulerOutput) -> None:
        self.plan.discard_transfers(output)

    def save(self, output: SchedulerOutput) -> None:
        self.agent.save(self.plan.take_saves(output))

    def idle(self, output: SchedulerOutput) -> None:
        """An empty step: start the disk reads of parked requests, and wait a little for one
        when requests wait on disk (nothing else can make progress: do not spin)."""
        try:
            self.agent.before_step(output.kv_transfers)
        except Exception:  # noqa: BLE001 - no request read these copies: forget them
            self.discard(output)
        if self.plan.fetch_waits:
            self.agent.wait(IDLE_WAIT_S)

    def clear(self, dropped: Sequence[BlockHash]) -> None:
        self.agent.clear_disk(dropped)
