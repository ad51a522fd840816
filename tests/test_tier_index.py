"""The compact index of a tier below host memory (:mod:`kvhal.tiers.index`).

A hypothesis state machine drives a :class:`TierIndex` and an
:class:`OffloadingManager` with the same policy through the same calls: with
the same free-slot order and the same policy they must give the same answers,
slot for slot and victim for victim; a small reference model checks both (and
the index alone once it has done what the manager cannot: forget, recover).
"""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis.stateful import invariant, precondition, rule

from kvhal.errors import BlockStateError, PolicyError, ValidationError
from kvhal.offload.eviction import ClockPolicy, LRUPolicy
from kvhal.offload.manager import BlockState, OffloadingManager, StorePlan
from kvhal.tiers.index import TierIndex
from tests.helpers import examples
from tests.slot_state_model import REGISTRY, UNIVERSE, SlotStateModel, as_test_case, key_lists


def keys_of(n: int, tag: bytes = b"k") -> list[bytes]:
    return [tag + i.to_bytes(8, "big") for i in range(n)]


def check_table(index: TierIndex) -> None:
    """The table holds each tracked slot once, every run in probe order (what lookups rely on)."""
    table, hashes, capacity = index._table, index._hashes, index._capacity
    taken = table[table >= 0]
    assert sorted(taken.tolist()) == np.flatnonzero(hashes).tolist()
    assert len(index) == len(taken) == index.num_slots - index.num_free
    assert sorted(index._free[: index.num_free].tolist()) == np.flatnonzero(hashes == 0).tolist()
    for place in np.flatnonzero(table >= 0).tolist():
        h = int(hashes[table[place]])
        distance = (place - h // index._divisor) % capacity
        before = table[(place - 1) % capacity]
        # Nothing empty between an entry's home and its place; a run is in (home, hash) order.
        assert all(table[(place - d) % capacity] >= 0 for d in range(distance + 1))
        if distance:  # the entry before homes earlier, or at the same place with a smaller hash
            prev = int(hashes[before])
            prev_distance = (place - 1 - prev // index._divisor) % capacity
            assert (prev_distance, -prev) > (distance - 1, -h)
        assert index._find(h) == table[place]


# -- the state machine ---------------------------------------------------------


class IndexMachine(SlotStateModel):
    policy = "lru"
    subject: TierIndex

    def make(self, num_slots: int) -> TierIndex:
        self.m: OffloadingManager | None = OffloadingManager(num_slots, self.policy, registry=REGISTRY)
        self.t = TierIndex(num_slots, self.policy, registry=REGISTRY)
        return self.t

    def call(self, name: str, *args):
        """Call ``name`` on both; the same answer or the same error type."""
        try:
            got = getattr(self.t, name)(*args)
        except Exception as exc:
            if self.m is not None:
                with pytest.raises(type(exc)):
                    getattr(self.m, name)(*args)
            raise
        if self.m is not None:
            assert getattr(self.m, name)(*args) == got
        return got

    def store(self, keys: list[bytes]) -> tuple[StorePlan | None, list[bytes]]:
        key_of = {self.t.slot(k): k for k in self.state}
        plan = self.t.prepare_store(keys)
        theirs = self.m.prepare_store(keys) if self.m is not None else plan
        if plan is None:
            assert theirs is None
            return None, []
        assert theirs is not None
        assert plan.keys == theirs.keys and plan.slots == theirs.slots
        evicted = [key_of[slot] for slot in plan.evicted]  # the index returns slots
        if self.m is not None:
            assert evicted == theirs.evicted
        return plan, evicted

    @rule(keys=key_lists)
    def forget(self, keys: list[bytes]) -> None:
        if any(self.state.get(k) == "storing" or self.loads[k] for k in keys):
            before = self.snapshot()
            with pytest.raises(BlockStateError):
                self.t.forget(keys)
            assert self.snapshot() == before
            return
        self.t.forget(keys)
        self.m = None  # the manager cannot forget: from here on the model alone
        for k in dict.fromkeys(keys):
            if k in self.state:
                del self.state[k]
                self.order.remove(k)

    @precondition(lambda self: not self.state)
    @rule(data=st.data())
    def recover(self, data) -> None:
        keys = data.draw(st.lists(st.sampled_from(UNIVERSE), unique=True, max_size=self.n))
        slots = data.draw(st.permutations(range(self.n)))[: len(keys)]
        assert self.t.recover(slots, keys) == len(keys)
        self.m = None
        for k, slot in zip(keys, slots, strict=True):
            assert self.t.slot(k) == slot
            self.state[k] = "ready"
        self.order = list(keys)

    @invariant()
    def matches_manager_and_table(self) -> None:
        if self.m is not None:
            assert self.snapshot()[0] == tuple(
                (self.m.state(k), self.m.slot(k), self.m.loads_in_flight(k)) for k in UNIVERSE
            )
        check_table(self.t)


class ClockIndexMachine(IndexMachine):
    policy = "clock"


TestLRUIndex = as_test_case(IndexMachine)
TestClockIndex = as_test_case(ClockIndexMachine)


# -- unit tests ----------------------------------------------------------------


def test_store_load_evict_roundtrip():
    index = TierIndex(4, "clock", registry=REGISTRY)
    keys = keys_of(6)
    plan = index.prepare_store(keys[:4])
    assert plan.keys == keys[:4] and plan.slots == [0, 1, 2, 3] and plan.evicted == []
    assert index.lookup(keys) == 0  # storing is not loadable
    index.complete_store(plan.keys)
    assert index.lookup(keys) == 4 and index.num_evictable == 4
    assert index.prepare_load(keys[:2]) == [0, 1]
    index.touch([keys[3]])
    plan = index.prepare_store(keys[4:])
    assert plan.evicted == [2, 3]  # 0, 1 are being loaded; 3, used, is passed over once
    assert index.state(keys[2]) is BlockState.ABSENT and index.slot(keys[4]) in (2, 3)
    assert index.prepare_store(keys_of(1, b"x")) is None  # two loads and two stores in flight
    index.complete_load(keys[:2])
    index.complete_store(keys[4:], success=False)
    assert len(index) == 2 and index.num_free == 2


def test_forget_drops_ready_keys_only():
    index = TierIndex(3, "lru", registry=REGISTRY)
    keys = keys_of(3)
    index.complete_store(index.prepare_store(keys[:2]).keys)
    index.prepare_store(keys[2:])
    index.prepare_load(keys[:1])
    for busy in (keys[0], keys[2]):  # a load in flight, a store in flight
        with pytest.raises(BlockStateError, match="only idle blocks are forgotten"):
            index.forget([keys[1], busy])
        assert index.state(keys[1]) is BlockState.READY  # nothing changed
    index.forget([keys[1], keys[1], b"unknown"])
    assert index.state(keys[1]) is BlockState.ABSENT and index.num_free == 1
    assert index.num_evictable == 0
    index.complete_load(keys[:1])
    index.forget(keys[:1])
    assert index.prepare_store([b"a", b"b"]).slots == [0, 1]  # lowest free slots first


class TinyHash(TierIndex):
    """Keys hash to their first byte: b"\\x05a" and b"\\x05b" collide."""

    key_hash = staticmethod(lambda key: key[0])


def test_a_hash_collision_costs_a_recompute_not_wrong_kv():
    index = TinyHash(4, registry=REGISTRY)
    stored, twin = b"\x05stored", b"\x05twin"
    index.complete_store(index.prepare_store([stored]).keys)
    # The twin looks present: a store skips it, a lookup finds the stored key's slot.
    assert index.prepare_store([twin, b"\x06other"]).keys == [b"\x06other"]
    assert index.lookup([twin]) == 1
    slot = index.prepare_load([twin])[0]
    assert slot == index.slot(stored)
    # The backend reads slot's full key, finds ``stored`` and answers "missing": the chain ends
    # the load and forgets the twin, which drops the one entry both keys share.
    index.complete_load([twin])
    index.forget([twin])
    assert index.lookup([stored]) == 0 and index.state(twin) is BlockState.ABSENT
    plan = index.prepare_store([twin])
    assert plan.keys == [twin] and len(index) == 2


def test_hash_zero_is_not_an_empty_slot():
    index = TinyHash(2, registry=REGISTRY)
    index.complete_store(index.prepare_store([b"\x00zero", b"\x02two"]).keys)
    assert index.lookup([b"\x00zero", b"\x02two"]) == 2
    check_table(index)


def test_a_crowded_table_wraps_around():
    """Every hash homes at the table's last place: the run wraps to its start."""

    class LastPlace(TierIndex):
        key_hash = staticmethod(lambda key: (1 << 64) - 1 - key[0])

    index = LastPlace(5, "lru", registry=REGISTRY)
    keys = [bytes([i]) for i in range(5)]
    index.complete_store(index.prepare_store(keys).keys)
    check_table(index)
    index.forget(keys[1:3])
    check_table(index)
    assert index.lookup([keys[0], keys[3], keys[4]]) == 3 and index.lookup(keys[1:2]) == 0
    recovered = LastPlace(5, "lru", registry=REGISTRY)
    assert recovered.recover([4, 0, 2, 1, 3], keys) == 5
    check_table(recovered)
    assert [recovered.slot(k) for k in keys] == [4, 0, 2, 1, 3]


@settings(max_examples=examples(60), deadline=None)
@given(num_slots=st.integers(1, 250), data=st.data(), small_hashes=st.booleans())
def test_recover_round_trip(num_slots, data, small_hashes):
    """A bulk-built table answers like one built key by key, and keeps working afterwards."""
    n = data.draw(st.integers(0, num_slots))
    if small_hashes:  # crowded homes; distinct first bytes (a TinyHash collision is not the point)
        cls, keys = TinyHash, [bytes([i]) + b"key" for i in range(1, n + 1)]
    else:
        cls, keys = TierIndex, [i.to_bytes(2, "big") + b"key" for i in range(n)]
    slots = data.draw(st.permutations(range(num_slots)))[:n]
    index = cls(num_slots, "clock", registry=REGISTRY)
    assert index.recover(np.array(slots, dtype=np.int64), keys) == n
    check_table(index)
    assert [index.slot(k) for k in keys] == slots
    assert index.lookup(keys) == n and index.num_evictable == n and index.num_free == num_slots - n
    index.forget(keys[::2])
    check_table(index)
    assert [index.state(k) is BlockState.READY for k in keys] == [i % 2 == 1 for i in range(n)]
    if not small_hashes:
        fresh = [b"fresh" + i.to_bytes(4, "big") for i in range(num_slots)]
        plan = index.prepare_store(fresh)
        assert sorted(plan.slots) == list(range(num_slots))
        assert sorted(plan.evicted) == sorted(slots[1::2])
        index.complete_store(plan.keys)
        check_table(index)
        assert index.lookup(keys[1:2]) == 0 and index.lookup(fresh) == num_slots


def test_recover_keeps_one_of_a_repeated_key():
    index = TinyHash(4, registry=REGISTRY)
    assert index.recover([3, 1, 2], [b"\x01a", b"\x02b", b"\x01c"]) == 2  # \x01c collides with \x01a
    assert index.slot(b"\x01a") == 3 and index.slot(b"\x02b") == 1
    assert index.num_free == 2 and index.prepare_store([b"\x03", b"\x04"]).slots == [0, 2]
    check_table(index)


def test_recover_refuses_bad_input_and_a_used_index():
    index = TierIndex(4, registry=REGISTRY)
    for slots, keys, match in [
        ([0, 1], [b"a"], "one slot per key"),
        ([0, 4], [b"a", b"b"], r"not in \[0, 4\)"),
        ([-1], [b"a"], r"not in \[0, 4\)"),
        ([2, 2], [b"a", b"b"], "listed twice"),
        ([0.5], [b"a"], "slot ids are ints"),
        ([0], ["a"], "keys are bytes"),
        ([0], b"a", "single bytes"),
    ]:
        with pytest.raises(ValidationError, match=match):
            index.recover(slots, keys)
        assert len(index) == 0 and index.num_free == 4
    assert index.recover([], []) == 0
    index.prepare_store([b"a"])
    with pytest.raises(BlockStateError, match="empty index"):
        index.recover([1], [b"b"])


def test_bad_input_is_refused():
    index = TierIndex(2, registry=REGISTRY)
    with pytest.raises(ValidationError, match="single bytes"):
        index.lookup(b"abc")
    with pytest.raises(ValidationError, match="single str"):
        index.prepare_store("abc")
    with pytest.raises(ValidationError, match="keys are bytes"):
        index.prepare_store([b"a", 3])
    with pytest.raises(ValidationError, match="keys are bytes"):
        index.lookup([bytearray(b"a")])
    with pytest.raises(ValidationError, match="iterable"):
        index.touch(5)
    assert len(index) == 0
    with pytest.raises(ValidationError, match="num_slots"):
        TierIndex(0)
    with pytest.raises(ValidationError, match="policy"):
        TierIndex(4, LRUPolicy(5))
    with pytest.raises(ValidationError, match="unknown eviction policy 'lfu'"):
        TierIndex(4, "lfu", registry=REGISTRY)
    with pytest.raises(BlockStateError, match="not offloaded"):
        index.prepare_load([b"a"])


def test_a_policy_breaking_its_contract_is_caught():
    class Reckless(ClockPolicy):
        def evict(self, n, pinned):
            return [0] * n  # slot 0 is being loaded

    index = TierIndex(2, Reckless(2), registry=REGISTRY)
    index.complete_store(index.prepare_store([b"a", b"b"]).keys)
    index.prepare_load([b"a"])
    with pytest.raises(PolicyError):
        index.prepare_store([b"c"])


# -- the clock policy ------------------------------------------------------------


def test_clock_gives_used_slots_a_second_chance():
    policy = ClockPolicy(5)
    policy.insert([0, 1, 2, 3], [b""] * 4)
    policy.touch([1, 2])
    unpinned = np.zeros(5, dtype=np.int16)
    assert policy.evict(2, unpinned) == [0, 3]
    assert policy.evict(1, unpinned) == [1]  # marks cleared by the first sweep
    policy.insert([0], [b""])
    policy.touch([0])
    assert policy.evict(2, [0] * 5) == [2, 0]  # a list as ``pinned`` works too
    with pytest.raises(PolicyError, match="found 0 unpinned slots, 1 asked for"):
        policy.evict(1, unpinned)


def test_clock_skips_pinned_and_removed_slots_over_many_windows():
    n = 100_000
    policy = ClockPolicy(n)
    policy.insert(np.arange(n), [])
    policy.remove(range(0, 50_000))
    pinned = np.zeros(n, dtype=np.int16)
    pinned[50_000:99_990] = -1
    policy.touch(list(range(99_990, 99_995)))
    assert policy.evict(10, pinned) == list(range(99_995, 100_000)) + list(range(99_990, 99_995))
    with pytest.raises(PolicyError):
        policy.evict(1, pinned)


def test_clock_is_offered_to_the_host_tier_manager_too():
    manager = OffloadingManager(2, "clock", registry=REGISTRY)
    assert isinstance(manager.policy, ClockPolicy)
    manager.complete_store(manager.prepare_store([b"a", b"b"]).keys)
    manager.touch([b"a"])
    assert manager.prepare_store([b"c"]).evicted == [b"b"]


def test_bench_drives_the_index_like_the_manager():
    from kvhal.bench.drivers import KvhalDriver, TierIndexDriver
    from kvhal.bench.manager import TraceSpec, make_trace, replay
    from kvhal.bench.tier_index import measure_recover

    trace = make_trace(TraceSpec(documents=5, prefix_blocks=4, tail_blocks=1, requests=200))
    ours = replay(TierIndexDriver(16, "clock", REGISTRY), trace, inflight=2, tick=lambda: None)
    theirs = replay(KvhalDriver(16, "clock", REGISTRY), trace, inflight=2, tick=lambda: None)
    assert (ours.hits, ours.stored) == (theirs.hits, theirs.stored) and 0 < ours.hits < ours.blocks
    figure = measure_recover(1000, repeats=1)
    assert figure["blocks"] == 1000 and figure["blocks_per_s"] > 0
