"""The offloading manager against a small reference model (hypothesis state machine).

The model knows each key's state (storing / ready), its loads in flight and,
for LRU, the recency order vLLM 0.32's LRU keeps. Checked after every step:
capacity never exceeded, no block in use evicted, only successfully stored
blocks loadable, events equal to the state changes, and a refused call
leaves the state unchanged.
"""

from __future__ import annotations

from collections import Counter

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvhal.errors import BlockStateError
from kvhal.manager import BlockState, OffloadEvent, OffloadingManager
from kvhal.registry import PluginRegistry

REGISTRY = PluginRegistry(autoload=False, allow=None, block=())
# Keys of two KV cache groups (vLLM's OffloadKey: hash + 4-byte group index).
UNIVERSE = [bytes([h]) * 4 + g.to_bytes(4, "big") for h in range(6) for g in (0, 1)]
key_lists = st.lists(st.sampled_from(UNIVERSE), max_size=5)


class ManagerMachine(RuleBasedStateMachine):
    policy = "lru"

    @initialize(num_slots=st.integers(1, 6))
    def start(self, num_slots: int) -> None:
        self.n = num_slots
        self.m = OffloadingManager(num_slots, self.policy, registry=REGISTRY, enable_events=True)
        self.state: dict[bytes, str] = {}  # key -> "storing" | "ready"
        self.loads: Counter[bytes] = Counter()
        self.order: list[bytes] = []  # LRU: least recent first
        self.events: list[OffloadEvent] = []

    # -- helpers -------------------------------------------------------------

    def snapshot(self) -> tuple:
        m = self.m
        per_key = tuple((m.state(k), m.slot(k), m.loads_in_flight(k)) for k in UNIVERSE)
        return per_key, m.num_free, m.num_evictable, m.num_storing, len(m)

    def refused(self, call, *args) -> None:
        self.take_events()  # checks and clears the events so far
        before = self.snapshot()
        with pytest.raises(BlockStateError):
            call(*args)
        assert self.snapshot() == before
        assert not self.m.take_events()  # a refused call records nothing

    def evictable(self, protected: set[bytes]) -> list[bytes]:
        return [
            k for k in self.order if self.state[k] == "ready" and not self.loads[k] and k not in protected
        ]

    # -- rules ---------------------------------------------------------------

    @rule(keys=key_lists)
    def prepare_store(self, keys: list[bytes]) -> None:
        unique = list(dict.fromkeys(keys))
        new = [k for k in unique if k not in self.state]
        need = len(new) - (self.n - len(self.state))
        candidates = self.evictable(set(unique))
        plan = self.m.prepare_store(keys)
        if need > len(candidates):
            assert plan is None
            return
        assert plan is not None
        assert plan.keys == new
        assert len(plan.evicted) == max(need, 0)
        for k in plan.evicted:  # never a block in use, never one of this call's
            assert k in candidates
        if self.policy == "lru":
            assert plan.evicted == candidates[: max(need, 0)]
        for k in plan.evicted:
            del self.state[k]
            self.order.remove(k)
        if plan.evicted:
            self.events.append(OffloadEvent(plan.evicted, removed=True))
        assert len(set(plan.slots)) == len(plan.slots)
        for k, slot in zip(plan.keys, plan.slots, strict=True):
            self.state[k] = "storing"
            self.order.append(k)
            assert self.m.slot(k) == slot

    @rule(data=st.data(), success=st.booleans())
    def complete_store(self, data, success: bool) -> None:
        storing = [k for k, s in self.state.items() if s == "storing"]
        keys = data.draw(st.lists(st.sampled_from(storing), unique=True)) if storing else []
        self.m.complete_store(keys, success=success)
        for k in keys:
            if success:
                self.state[k] = "ready"
            else:
                del self.state[k]
                self.order.remove(k)
        if keys and success:  # a failed store was never announced: no event
            self.events.append(OffloadEvent(keys, removed=False))

    @rule(key=st.sampled_from(UNIVERSE))
    def complete_store_refused(self, key: bytes) -> None:
        if self.state.get(key) != "storing":  # unknown, or completed already
            self.refused(self.m.complete_store, [key])

    @rule(keys=key_lists)
    def prepare_load(self, keys: list[bytes]) -> None:
        if all(self.state.get(k) == "ready" for k in keys):
            slots = self.m.prepare_load(keys)
            assert slots == [self.m.slot(k) for k in keys]
            self.loads.update(keys)
        else:  # a missing or not-ready block
            self.refused(self.m.prepare_load, keys)

    @precondition(lambda self: +self.loads)
    @rule(data=st.data())
    def complete_load(self, data) -> None:
        key = data.draw(st.sampled_from(sorted(+self.loads)))
        self.m.complete_load([key])
        self.loads[key] -= 1

    @rule(key=st.sampled_from(UNIVERSE))
    def complete_load_refused(self, key: bytes) -> None:
        if not self.loads[key]:
            self.refused(self.m.complete_load, [key])

    @rule(keys=key_lists)
    def touch(self, keys: list[bytes]) -> None:
        self.m.touch(keys)
        for k in reversed(keys):  # the first key ends most recent
            if k in self.state:
                self.order.remove(k)
                self.order.append(k)

    @rule(keys=key_lists)
    def lookup(self, keys: list[bytes]) -> None:
        expected = 0
        for k in keys:
            if self.state.get(k) != "ready":
                break
            expected += 1
        assert self.m.lookup(keys) == expected

    @rule()
    def take_events(self) -> None:
        assert self.m.take_events() == self.events
        self.events = []

    # -- invariants ----------------------------------------------------------

    @invariant()
    def matches_model(self) -> None:
        m = self.m
        assert len(m) == len(self.state) <= self.n
        assert m.num_free == self.n - len(self.state)
        for k in UNIVERSE:
            want = {"storing": BlockState.STORING, "ready": BlockState.READY}.get(
                self.state.get(k), BlockState.ABSENT
            )
            assert m.state(k) is want
            assert m.loads_in_flight(k) == self.loads[k]
        slots = [m.slot(k) for k in self.state]
        assert len(set(slots)) == len(slots)
        assert m.num_evictable == len(self.evictable(set()))
        assert m.num_storing == sum(s == "storing" for s in self.state.values())


class S3FIFOMachine(ManagerMachine):
    """The same rules with S3-FIFO: every safety check, but not LRU's exact victims."""

    policy = "s3fifo"


STEPS = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestLRUManager = ManagerMachine.TestCase
TestLRUManager.settings = STEPS
TestS3FIFOManager = S3FIFOMachine.TestCase
TestS3FIFOManager.settings = STEPS
