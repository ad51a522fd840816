"""The key index against callers that try to break it (issue 38): keys that are bytes
subclasses whose __hash__ or __eq__ raises or changes the index or the very list being read,
slots whose __index__ does the same, non-bytes keys, huge keys, an index never initialised.

Each must be refused (TypeError, ValueError, KeyError, RuntimeError) or served, never crash
the process nor leave the index inconsistent. The three crashes the issue names run in a
subprocess first (they took the interpreter down before the fix: SIGSEGV, or a read of freed
memory); the properties run in-process, and again under AddressSanitizer in
tests/test_sanitizers.py.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from kvhal.offload import keyindex
from kvhal.offload.keyindex import PyKeyIndex
from tests.helpers import examples

IMPLEMENTATIONS = [PyKeyIndex]
if keyindex.NATIVE:
    IMPLEMENTATIONS.append(keyindex.KeyIndex)
by_module = pytest.mark.parametrize("impl_cls", IMPLEMENTATIONS, ids=lambda cls: cls.__module__)
REFUSED = (TypeError, ValueError, KeyError, RuntimeError, ZeroDivisionError)

# The issue's three crashes, each in a process of its own.
CRASHES = {
    "used without __init__ (a NULL table)": """
        index = KeyIndex.__new__(KeyIndex)
        for call in (lambda: index.get(b"k"), lambda: index.slots([b"k"]), lambda: b"k" in index,
                     lambda: index.add([b"k"], [0]), lambda: index.remove([0]), lambda: index.key(0)):
            try:
                call()
            except (RuntimeError, ValueError) as exc:
                print(type(exc).__name__)
        print(len(index))
    """,
    "remove() after a subclass key's __eq__ raised": """
        class Key(bytes):
            armed = False
            def __hash__(self):
                return hash(b"a")
            def __eq__(self, other):
                if Key.armed:
                    raise ValueError("no")
                return bytes.__eq__(self, other)
        index = KeyIndex(tuple(range(8)))
        for key, slot in ((Key(b"zz"), 0), (b"a", 1)):
            try:
                index.add([key], [slot])
            except TypeError as exc:
                print(exc)
        Key.armed = True
        print(index.remove([1]), index.get(b"a"), len(index))
    """,
    "slots() of a list a key's __hash__ empties": """
        keys = []
        class Key(bytes):
            def __hash__(self):
                keys.clear()
                return 1
        keys.extend([Key(b"k0"), Key(b"k1")] + [bytes(1000) + b"%d" % n for n in range(200)])
        index = KeyIndex(tuple(range(8)))
        try:
            index.slots(keys)
        except TypeError as exc:
            print(exc)
        print(len(keys))
    """,
}


@pytest.mark.skipif(not keyindex.NATIVE, reason="the native index is not built")
@pytest.mark.parametrize("case", list(CRASHES))
def test_the_issues_crashes_are_refused(case):
    code = "from kvhal.offload._keyindex import KeyIndex\n" + textwrap.dedent(CRASHES[case])
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{case}: exit {done.returncode}\n{done.stderr[-2000:]}"
    assert "Error" not in done.stderr


def _consistent(index, num_slots: int) -> dict[bytes, int]:
    """The index agrees with itself: every slot's key maps back to that slot, once."""
    held = {}
    for slot in range(num_slots):
        key = index.key(slot)
        if key is not None:
            assert type(key) is bytes and key not in held
            held[key] = slot
    assert len(index) == len(held)
    assert index.slots(list(held)) == list(held.values())
    for key, slot in held.items():
        assert index.get(key) == slot and key in index
    return held


class Hostile:
    """What a hostile key or slot does when the index calls into it: mutate the list being
    read, change the index itself, raise."""

    def __init__(self, index, victims: list, action: str) -> None:
        self.index, self.victims, self.action = index, victims, action

    def __call__(self) -> None:
        if self.action == "clear-list":
            self.victims.clear()
        elif self.action == "grow-list":
            self.victims.extend([b"x" * 64] * 64)
        elif self.action == "remove-all":
            taken = [s for s in range(self.index.num_slots) if self.index.key(s) is not None]
            if taken:
                self.index.remove(taken)
        elif self.action == "add-one":
            free = [s for s in range(self.index.num_slots) if self.index.key(s) is None]
            if free and b"intruder" not in self.index:
                self.index.add([b"intruder"], [free[0]])
        elif self.action == "raise":
            raise ZeroDivisionError("hostile")


def hostile_key(base: bytes, act: Hostile, where: str) -> object:
    class Key(bytes):
        def __hash__(self):
            if where == "hash":
                act()
            return hash(bytes(self))

        def __eq__(self, other):
            if where == "eq":
                act()
            return bytes(self) == other

    return Key(base)


class HostileSlot(int):
    """An int subclass whose hooks run the hostile action (the index reads its value directly)."""

    def __new__(cls, value: int, act: Hostile):
        self = super().__new__(cls, value)
        self.act = act
        return self

    def __index__(self) -> int:
        self.act()
        return int(self)

    def __hash__(self) -> int:
        self.act()
        return int.__hash__(self)


class IndexSlot:
    """Not an int: an object whose __index__ runs the hostile action each time it is read."""

    def __init__(self, value: int, act: Hostile) -> None:
        self.value, self.act = value, act

    def __index__(self) -> int:
        self.act()
        return self.value


ACTIONS = ["clear-list", "grow-list", "remove-all", "add-one", "raise"]
good_keys = st.one_of(
    st.binary(max_size=3),
    st.sampled_from([b"", b"\0" * (1 << 16), b"k" * 70000]),  # huge keys (real ones: 36 bytes)
)
calls = st.sampled_from(["add", "remove", "get", "slots", "contains", "key"])
kinds = st.sampled_from(
    ["bytes", "subclass-hash", "subclass-eq", "str", "int", "bytearray", "memoryview", "none"]
)


@by_module
@settings(max_examples=examples(200), deadline=None)
@given(data=st.data())
def test_hostile_keys_and_slots_are_refused_or_served(impl_cls, data):
    num_slots = 8
    index = impl_cls(tuple(range(num_slots)))
    for _ in range(data.draw(st.integers(1, 12), label="calls")):
        call = data.draw(calls, label="call")
        action = data.draw(st.sampled_from(ACTIONS), label="action")
        victims: list = []
        act = Hostile(index, victims, action)
        n = data.draw(st.integers(0, 4), label="n")
        for _ in range(n):
            base, kind = data.draw(good_keys, label="key"), data.draw(kinds, label="kind")
            key = {
                "bytes": base,
                "subclass-hash": hostile_key(base, act, "hash"),
                "subclass-eq": hostile_key(base, act, "eq"),
                "str": base.decode("latin-1"),
                "int": len(base),
                "bytearray": bytearray(base),
                "memoryview": memoryview(base),
                "none": None,
            }[kind]
            victims.append(key)
        slot_kind = data.draw(
            st.sampled_from(["int", "int-subclass", "__index__", "out-of-range"]), label="slots"
        )
        slots = [data.draw(st.integers(0, num_slots - 1), label="slot") for _ in victims]
        if slot_kind == "int-subclass":
            slots = [HostileSlot(s, act) for s in slots]
        elif slot_kind == "__index__":
            slots = [IndexSlot(s, act) for s in slots]
        elif slot_kind == "out-of-range" and slots:
            slots[0] = data.draw(st.sampled_from([-1, num_slots, 2**31, -(2**63), 2**64]))
        exact = all(type(k) is bytes for k in victims)
        one_bad = bool(victims) and call in ("get", "contains") and type(victims[0]) is not bytes
        refused = None
        try:
            if call == "add":
                index.add(victims, slots)
            elif call == "remove":
                removed = index.remove(slots)
                assert all(k is None or type(k) is bytes for k in removed)
            elif call == "slots":
                found = index.slots(victims)
                assert all(s is None or 0 <= s < num_slots for s in found)
            elif call == "get" and victims:
                index.get(victims[0])
            elif call == "contains" and victims:
                _ = victims[0] in index
            elif call == "key" and victims:
                key = index.key(slots[0])
                assert key is None or type(key) is bytes
        except REFUSED as exc:
            refused = exc
        if not exact and (call in ("add", "slots") or one_bad):
            assert refused is not None, f"{call} took a key of type {[type(k).__name__ for k in victims]}"
        _consistent(index, num_slots)


@by_module
def test_a_subclass_or_other_type_is_refused_where_keys_go_in(impl_cls):
    class Key(bytes):
        pass

    index = impl_cls(tuple(range(4)))
    index.add([b"a"], [0])
    for bad in (Key(b"a"), Key(b"b"), "a", bytearray(b"a"), memoryview(b"a"), 1, None):
        for call, args in ((index.add, ([bad], [1])), (index.get, (bad,)), (index.slots, ([b"a", bad],))):
            with pytest.raises(TypeError, match="keys are bytes"):
                call(*args)
        with pytest.raises(TypeError, match="keys are bytes"):
            _ = bad in index
    assert len(index) == 1 and index.get(b"a") == 0 and index.key(1) is None


@pytest.mark.skipif(not keyindex.NATIVE, reason="the native index is not built")
def test_an_index_never_initialised_refuses_every_call():
    index = keyindex.KeyIndex.__new__(keyindex.KeyIndex)
    for call in (
        lambda: index.get(b"k"),
        lambda: index.slots([b"k"]),
        lambda: b"k" in index,
        lambda: index.add([b"k"], [0]),
        lambda: index.remove([0]),
        lambda: index.key(0),
    ):
        with pytest.raises(RuntimeError, match="not initialized"):
            call()
    assert len(index) == 0
    index.__init__(tuple(range(2)))  # and it can still be made whole
    index.add([b"k"], [1])
    assert index.get(b"k") == 1
    with pytest.raises(RuntimeError, match="already initialized"):
        index.__init__(tuple(range(2)))
