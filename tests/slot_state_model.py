"""The reference model both slot state machines are checked against (hypothesis stateful).

:class:`SlotStateModel` knows each key's state (storing / ready), its loads in
flight and, for LRU, the recency order vLLM 0.32's LRU keeps; its rules drive the
calls :class:`~kvhal.offload.slot_states.SlotStates` implements and check, after every
step, that capacity is never exceeded, no block in use is evicted, only
successfully stored blocks are loadable, and a refused call leaves the state
unchanged. A test subclasses it and supplies :meth:`make` and :meth:`store`.
"""

from __future__ import annotations

from collections import Counter

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvhal.errors import BlockStateError
from kvhal.offload.manager import BlockState, StorePlan
from kvhal.offload.slot_states import SlotStates
from kvhal.registry import PluginRegistry
from tests.helpers import examples

REGISTRY = PluginRegistry(autoload=False, allow=None, block=())
# Keys of two KV cache groups (vLLM's OffloadKey: hash + 4-byte group index).
UNIVERSE = [bytes([h]) * 4 + g.to_bytes(4, "big") for h in range(6) for g in (0, 1)]
key_lists = st.lists(st.sampled_from(UNIVERSE), max_size=5)
STEPS = settings(max_examples=examples(150), stateful_step_count=40, deadline=None)


def as_test_case(machine: type[RuleBasedStateMachine]) -> type:
    """``machine``'s pytest class, run for :data:`STEPS`."""
    case = machine.TestCase
    case.settings = STEPS
    return case


class SlotStateModel(RuleBasedStateMachine):
    policy = "lru"
    subject: SlotStates

    # -- what a test supplies ------------------------------------------------

    def make(self, num_slots: int) -> SlotStates:
        """The object under test, with ``num_slots`` slots and :attr:`policy`."""
        raise NotImplementedError

    def store(self, keys: list[bytes]) -> tuple[StorePlan | None, list[bytes]]:
        """Call ``prepare_store``: its plan and the keys it evicted."""
        raise NotImplementedError

    def call(self, name: str, *args):
        """Call ``name`` on the object under test."""
        return getattr(self.subject, name)(*args)

    def stored(self, keys: list[bytes], success: bool) -> None:
        """``complete_store(keys, success)`` returned."""

    # -- helpers -------------------------------------------------------------

    @initialize(num_slots=st.integers(1, 6))
    def start(self, num_slots: int) -> None:
        self.n = num_slots
        self.state: dict[bytes, str] = {}  # key -> "storing" | "ready"
        self.loads: Counter[bytes] = Counter()
        self.order: list[bytes] = []  # LRU: least recent first
        self.subject = self.make(num_slots)

    def snapshot(self) -> tuple:
        subject = self.subject
        per_key = tuple((subject.state(k), subject.slot(k), subject.loads_in_flight(k)) for k in UNIVERSE)
        return per_key, subject.num_free, subject.num_evictable, subject.num_storing, len(subject)

    def refused(self, name: str, *args) -> None:
        before = self.snapshot()
        with pytest.raises(BlockStateError):
            self.call(name, *args)
        assert self.snapshot() == before

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
        plan, evicted = self.store(keys)
        if need > len(candidates):
            assert plan is None
            return
        assert plan is not None
        assert plan.keys == new
        assert len(evicted) == max(need, 0)
        assert set(evicted) <= set(candidates)  # never a block in use, never one of this call's
        if self.policy == "lru":
            assert evicted == candidates[: max(need, 0)]
        for k in evicted:
            del self.state[k]
            self.order.remove(k)
        assert len(set(plan.slots)) == len(plan.slots)
        for k, slot in zip(plan.keys, plan.slots, strict=True):
            self.state[k] = "storing"
            self.order.append(k)
            assert self.subject.slot(k) == slot

    @rule(data=st.data(), success=st.booleans())
    def complete_store(self, data, success: bool) -> None:
        storing = [k for k, s in self.state.items() if s == "storing"]
        keys = data.draw(st.lists(st.sampled_from(storing), unique=True)) if storing else []
        self.call("complete_store", keys, success)
        for k in keys:
            if success:
                self.state[k] = "ready"
            else:
                del self.state[k]
                self.order.remove(k)
        self.stored(keys, success)

    @rule(key=st.sampled_from(UNIVERSE))
    def complete_store_refused(self, key: bytes) -> None:
        if self.state.get(key) != "storing":  # unknown, or completed already
            self.refused("complete_store", [key])

    @rule(keys=key_lists)
    def prepare_load(self, keys: list[bytes]) -> None:
        if all(self.state.get(k) == "ready" for k in keys):
            slots = self.call("prepare_load", keys)
            assert slots == [self.subject.slot(k) for k in keys]
            self.loads.update(keys)
        else:  # a missing or not-ready block
            self.refused("prepare_load", keys)

    @precondition(lambda self: +self.loads)
    @rule(data=st.data())
    def complete_load(self, data) -> None:
        loaded = sorted(+self.loads)
        keys = data.draw(st.lists(st.sampled_from(loaded), min_size=1, max_size=3))
        if any(self.loads[k] < n for k, n in Counter(keys).items()):
            self.refused("complete_load", keys)
            return
        self.call("complete_load", keys)
        self.loads.subtract(keys)

    @rule(key=st.sampled_from(UNIVERSE))
    def complete_load_refused(self, key: bytes) -> None:
        if not self.loads[key]:
            self.refused("complete_load", [key])

    @rule(keys=key_lists)
    def touch(self, keys: list[bytes]) -> None:
        self.call("touch", keys)
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
        assert self.call("lookup", keys) == expected

    # -- invariants ----------------------------------------------------------

    @invariant()
    def matches_model(self) -> None:
        subject = self.subject
        assert len(subject) == len(self.state) <= self.n
        assert subject.num_free == self.n - len(self.state)
        for k in UNIVERSE:
            want = {"storing": BlockState.STORING, "ready": BlockState.READY}.get(
                self.state.get(k), BlockState.ABSENT
            )
            assert subject.state(k) is want
            assert subject.loads_in_flight(k) == self.loads[k]
        slots = [subject.slot(k) for k in self.state]
        assert len(set(slots)) == len(slots)
        assert subject.num_evictable == len(self.evictable(set()))
        assert subject.num_storing == sum(state == "storing" for state in self.state.values())
