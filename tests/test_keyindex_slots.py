"""The native slot passes (``_keyindex``'s ``LRU``, ``add_refs`` and ``KeyIndex.prefix``,
``_slots.c``) against the Python code they replace, and against callers that try to break them.

Properties: any sequence of calls leaves the native LRU in the Python LRUPolicy's order and
evicts the same slots; ``add_refs`` changes a states list as the manager's Python loops do, or
refuses and changes nothing; ``prefix`` is the manager's Python ``lookup``; a manager on the
native passes and one on the Python loops answer alike. Hostile input (bad types, slots out of
range, an ``__index__`` or a pinned sequence that calls back into the LRU, an uninitialised
object) is refused, never a crash; these run under AddressSanitizer in tests/test_sanitizers.py.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from kvhal.errors import BlockStateError, PolicyError
from kvhal.offload import keyindex
from kvhal.offload.eviction import LRUPolicy
from kvhal.offload.manager import OffloadingManager
from kvhal.offload.slot_states import SlotStates
from tests.helpers import examples

pytestmark = pytest.mark.skipif(not keyindex.NATIVE, reason="built without a C compiler")
if keyindex.NATIVE:
    from kvhal.offload._keyindex import LRU, KeyIndex, add_refs


class PyLRU(LRUPolicy):
    """A subclass keeps the Python lists: the reference."""

    def order(self) -> list[int]:
        out, slot = [], self._next[self._nil]
        while slot != self._nil:
            out.append(slot)
            slot = self._next[slot]
        return out


N = 12
ops = st.lists(
    st.tuples(
        st.sampled_from(["insert", "touch", "remove", "evict"]),
        st.lists(st.integers(0, N - 1), max_size=6),
        st.lists(st.integers(0, 2), min_size=N, max_size=N),
    ),
    max_size=40,
)


@settings(max_examples=examples(200), deadline=None)
@given(ops)
def test_native_lru_keeps_the_python_order(calls):
    native, ref = LRU(N), PyLRU(N)
    linked: set[int] = set()
    for op, slots, pinned in calls:
        if op == "insert":
            slots = list(dict.fromkeys(s for s in slots if s not in linked))
            native.insert(slots, [b"k"] * len(slots))
            ref.insert(slots, [b"k"] * len(slots))
            linked.update(slots)
        elif op == "touch":
            slots = [s for s in slots if s in linked]  # repeats kept: the Python loop handles them
            native.touch(slots)
            ref.touch(slots)
        elif op == "remove":
            slots = list(dict.fromkeys(s for s in slots if s in linked))
            native.remove(slots)
            ref.remove(slots)
            linked.difference_update(slots)
        else:
            n = len(slots)
            free = sum(1 for s in linked if not pinned[s])
            got = native.evict(n, pinned)
            if n <= free:
                assert got == ref.evict(n, pinned)
                linked.difference_update(got)
            else:  # short: nothing taken (the Python loop takes some, then raises)
                assert len(got) < n
        assert native.order() == ref.order()
        assert len(native) == len(linked)


@settings(max_examples=examples(200), deadline=None)
@given(
    st.lists(st.integers(-1, 3), min_size=1, max_size=8),
    st.lists(st.one_of(st.none(), st.integers(0, 7)), max_size=8),
    st.sampled_from([-1, 1]),
    st.integers(-1, 2),
    st.integers(-1, 4),
)
def test_add_refs_is_the_python_loop_or_nothing(refs, slots, delta, lowest, highest):
    slots = [s if s is None or s < len(refs) else len(refs) - 1 for s in slots]
    expect, crossed, ok = list(refs), 0, True
    for slot in slots:  # the manager's loop, checking each state before its move
        if slot is None or not lowest <= expect[slot] <= highest:
            ok = False
            break
        before = expect[slot]
        expect[slot] += delta
        crossed += (before == 0) if delta > 0 else (expect[slot] == 0)
    got = list(refs)
    answer = add_refs(got, slots, delta, lowest, highest)
    if ok:
        assert (answer, got) == (crossed, expect)
    else:
        assert answer < 0 and got == refs
        bad = -1 - answer
        assert slots[bad] is None or not lowest <= _state_at(refs, slots, bad, delta) <= highest


def _state_at(refs, slots, i, delta):
    """The state ``slots[i]`` meets after the moves before it (a slot listed twice)."""
    return refs[slots[i]] + delta * slots[:i].count(slots[i])


@settings(max_examples=examples(100), deadline=None)
@given(st.lists(st.integers(0, 5), max_size=10), st.lists(st.integers(-1, 2), min_size=6, max_size=6))
def test_prefix_is_the_python_lookup(picks, states):
    index = KeyIndex(tuple(range(6)))
    index.add([bytes([k]) for k in range(4)], [0, 1, 2, 3])  # keys 4 and 5 are absent
    keys = [bytes([k]) for k in picks]
    slots = index.slots(keys)
    expect = 0
    for slot in slots:
        if slot is None or states[slot] < 0:
            break
        expect += 1
    assert index.prefix(keys, states) == expect


class PyManager(OffloadingManager):
    """The manager on SlotStates' Python loops and the Python LRU."""

    _add_refs = None
    lookup = SlotStates.lookup


def _apply(manager, op, keys):
    try:
        if op == "store":
            plan = manager.prepare_store(keys)
            return None if plan is None else (plan.keys, plan.slots, plan.evicted)
        return getattr(manager, op)(keys)
    except BlockStateError as exc:
        return str(exc)


@settings(max_examples=examples(100), deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["store", "complete_store", "prepare_load", "complete_load", "lookup", "touch"]),
            st.lists(st.integers(0, 9), max_size=5),
        ),
        max_size=40,
    )
)
def test_a_manager_on_the_native_passes_answers_as_on_python_loops(calls):
    native, ref = OffloadingManager(6), PyManager(6, PyLRU(6))
    for op, picks in calls:
        keys = [bytes([k]) * 4 for k in picks]
        assert _apply(native, op, keys) == _apply(ref, op, keys), (op, picks)
        assert (native.num_evictable, native.num_storing, len(native)) == (
            ref.num_evictable,
            ref.num_storing,
            len(ref),
        )
        assert native._refs == ref._refs


# -- hostile callers --------------------------------------------------------------------------

REFUSED = (TypeError, ValueError, RuntimeError, OverflowError)


def test_an_uninitialised_lru_refuses_every_call():
    lru = LRU.__new__(LRU)
    for call in (
        lambda: lru.insert([0]),
        lambda: lru.touch([0]),
        lambda: lru.remove([0]),
        lambda: lru.evict(1, [0]),
        lambda: lru.order(),
    ):
        with pytest.raises(RuntimeError, match="not initialized"):
            call()
    with pytest.raises(ValueError):
        LRU(0)
    with pytest.raises(RuntimeError, match="already"):
        LRU(2).__init__(2)


@pytest.mark.parametrize(
    "slots", [[5], [-1], [2**70], ["0"], [None], [0.0], 7, [0, 3]], ids=lambda s: repr(s)[:20]
)
def test_bad_slots_are_refused_and_nothing_changes(slots):
    lru = LRU(5)
    lru.insert([0, 1, 2])
    for call in (lru.touch, lru.remove, lru.insert):
        with pytest.raises(REFUSED):
            call(slots)
        assert lru.order() == [0, 1, 2]
    with pytest.raises(ValueError, match="twice"):
        lru.remove([1, 1])
    with pytest.raises(ValueError, match="twice"):
        lru.insert([3, 3])
    assert lru.order() == [0, 1, 2]


def test_a_slot_whose_index_calls_back_cannot_break_the_links():
    lru = LRU(4)
    lru.insert([0, 1, 2, 3])

    class Sneaky:
        def __index__(self):
            lru.remove([1, 2])  # runs while the call converts its slots, before any link changes
            return 1

    with pytest.raises(ValueError, match="not in the LRU"):
        lru.touch([0, Sneaky()])
    assert lru.order() == [0, 3]
    refs = [0, 0, 0]

    class Shrinks:
        def __index__(self):
            refs.clear()
            return 2

    assert add_refs(refs, [Shrinks()], 1, 0, 5) == -1  # its slot is past the list's end now: refused


def test_a_pinned_sequence_that_calls_back_is_refused_and_nothing_is_evicted():
    lru = LRU(4)
    lru.insert([0, 1, 2, 3])
    seen = []

    class Pinned:
        def __len__(self):
            return 4

        def __getitem__(self, slot):
            try:
                lru.touch([3])
            except RuntimeError as exc:
                seen.append(str(exc))
            if slot == 2:
                raise ZeroDivisionError("boom")
            return 0

    with pytest.raises(ZeroDivisionError):
        lru.evict(4, Pinned())
    assert seen and "busy" in seen[0]
    assert lru.order() == [0, 1, 2, 3]  # nothing taken
    assert lru.evict(1, [1, 0, 0, 0]) == [1]  # usable again
    with pytest.raises(TypeError):
        lru.evict(1, 5)
    with pytest.raises(ValueError):
        lru.evict(-1, [0] * 4)


def test_add_refs_and_prefix_refuse_bad_states():
    with pytest.raises(TypeError):
        add_refs((0, 0), [0], 1, 0, 1)

    class Refs(list):
        pass

    with pytest.raises(TypeError):
        add_refs(Refs([0]), [0], 1, 0, 1)
    refs = [0, "x", 2**80]
    with pytest.raises(TypeError, match="not an int"):
        add_refs(refs, [0, 1], 1, 0, 5)
    assert refs == [0, "x", 2**80]  # the first move undone
    assert add_refs(refs, [2], 1, 0, 5) == -1  # beyond the bounds: refused
    with pytest.raises(ValueError):
        add_refs(refs, [3], 1, 0, 5)
    with pytest.raises(ValueError):
        add_refs([0], [0], 2**40, 0, 5)
    top, bottom = 2**63 - 1, -(2**63)
    assert add_refs([top], [0], 1, 0, top) == -1  # past a C long long: refused, not wrapped
    assert add_refs([bottom], [0], -1, bottom, 0) == -1
    index = KeyIndex((0, 1))
    index.add([b"a"], [0])
    with pytest.raises(ValueError, match="states"):
        index.prefix([b"a"], [0])
    with pytest.raises(TypeError, match="bytes"):
        index.prefix([b"a", "b"], [0, 0])
    with pytest.raises(TypeError, match="not an int"):
        index.prefix([b"a"], ["x", 0])
    assert index.prefix([b"a"], [-(2**80), 0]) == 0
    assert index.prefix([b"a"], [2**80, 0]) == 1


def test_the_manager_refuses_as_before_on_the_native_passes():
    manager = OffloadingManager(4)
    plan = manager.prepare_store([b"a", b"b"])
    with pytest.raises(BlockStateError, match="still being stored"):
        manager.prepare_load([b"a"])
    with pytest.raises(BlockStateError, match="listed twice"):
        manager.complete_store([b"a", b"a"])
    manager.complete_store(plan.keys)
    manager.prepare_load([b"a", b"a"])
    manager.complete_load([b"a", b"a"])
    manager.prepare_load([b"a"])
    with pytest.raises(BlockStateError, match="listed 2 times, 1 loads"):
        manager.complete_load([b"a", b"a"])
    assert manager._refs[plan.slots[0]] == 1  # the refused call changed nothing
    with pytest.raises(PolicyError, match="found 1 unpinned"):
        manager.policy.evict(3, manager._refs)
