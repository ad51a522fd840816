"""The offloading manager against a small reference model (hypothesis state machine).

The model (:mod:`tests.slot_state_model`) knows each key's state (storing /
ready), its loads in flight and, for LRU, the recency order vLLM 0.32's LRU
keeps. Checked after every step: capacity never exceeded, no block in use
evicted, only successfully stored blocks loadable, events equal to the state
changes, and a refused call leaves the state unchanged.
"""

from __future__ import annotations

from hypothesis.stateful import rule

from kvhal.offload.manager import OffloadEvent, OffloadingManager, StorePlan
from tests.slot_state_model import REGISTRY, SlotStateModel, as_test_case


class ManagerMachine(SlotStateModel):
    policy = "lru"
    subject: OffloadingManager

    def make(self, num_slots: int) -> OffloadingManager:
        self.events: list[OffloadEvent] = []
        return OffloadingManager(num_slots, self.policy, registry=REGISTRY, enable_events=True)

    def store(self, keys: list[bytes]) -> tuple[StorePlan | None, list[bytes]]:
        plan = self.subject.prepare_store(keys)
        if plan is None:
            return None, []
        if plan.evicted:
            self.events.append(OffloadEvent(plan.evicted, removed=True))
        return plan, plan.evicted

    def stored(self, keys: list[bytes], success: bool) -> None:
        if keys and success:  # a failed store was never announced: no event
            self.events.append(OffloadEvent(keys, removed=False))

    def refused(self, name: str, *args) -> None:
        self.take_events()  # checks and clears the events so far
        super().refused(name, *args)
        assert not self.subject.take_events()  # a refused call records nothing

    @rule()
    def take_events(self) -> None:
        assert self.subject.take_events() == self.events
        self.events = []


class S3FIFOMachine(ManagerMachine):
    """The same rules with S3-FIFO: every safety check, but not LRU's exact victims."""

    policy = "s3fifo"


TestLRUManager = as_test_case(ManagerMachine)
TestS3FIFOManager = as_test_case(S3FIFOMachine)
