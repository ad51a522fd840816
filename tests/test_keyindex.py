"""The manager's key index: native and pure-Python, one contract, checked against a dict."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from kvhal.offload import keyindex
from kvhal.offload.keyindex import PyKeyIndex
from tests.helpers import examples

IMPLEMENTATIONS = [PyKeyIndex]
if keyindex.NATIVE:
    IMPLEMENTATIONS.append(keyindex.KeyIndex)


@pytest.fixture(params=IMPLEMENTATIONS, ids=lambda cls: cls.__module__)
def impl(request):
    return request.param


def test_native_index_is_built():
    """setup.py builds it wherever a C compiler exists (CI does): the memory target needs it."""
    assert keyindex.NATIVE


# Short keys collide in the table a lot; ops: add a key, remove a slot.
ops = st.lists(st.tuples(st.booleans(), st.binary(min_size=0, max_size=2), st.integers(0, 15)), max_size=300)


@pytest.mark.parametrize("impl_cls", IMPLEMENTATIONS, ids=lambda cls: cls.__module__)
@settings(max_examples=examples(150), deadline=None)
@given(ops=ops)
def test_matches_a_dict_under_churn(impl_cls, ops):
    ids = tuple(range(16))
    index, model = impl_cls(ids), {}
    for add, key, slot in ops:
        if add and key not in model and slot not in model.values():
            index.add([key], [slot])
            model[key] = slot
        elif not add and slot in model.values():
            [removed] = index.remove([slot])
            assert model.pop(removed) == slot
        assert len(index) == len(model)
    for key, slot in model.items():
        assert index.get(key) == slot and key in index and index.key(slot) == key
        assert index.get(key) is ids[slot]  # the caller's own int object
    probes = [bytes([a, b]) for a in range(0, 256, 37) for b in range(0, 256, 51)] + list(model)
    assert index.slots(probes) == [model.get(p) for p in probes]


def test_add_is_all_or_nothing(impl):
    index = impl(tuple(range(4)))
    index.add([b"a"], [0])
    for keys, slots, error in [
        ([b"b", b"a"], [1, 2], KeyError),  # b"a" is present
        ([b"b", b"c"], [1, 0], ValueError),  # slot 0 is taken
        ([b"b", "c"], [1, 2], TypeError),  # not bytes
        ([b"b", b"c"], [1, 9], ValueError),  # out of range
        ([b"b", b"b"], [1, 2], KeyError),  # repeated in the call
    ]:
        with pytest.raises(error):
            index.add(keys, slots)
        assert len(index) == 1 and index.get(b"b") is None and index.key(1) is None


def test_remove_checks_every_slot_first(impl):
    index = impl(tuple(range(4)))
    index.add([b"a", b"b"], [0, 1])
    with pytest.raises(KeyError):
        index.remove([0, 2])
    assert len(index) == 2
    assert index.remove([1, 0]) == [b"b", b"a"] and len(index) == 0


@pytest.mark.parametrize("ids", [(), (1, 0), [0, 1]])
def test_ids_must_be_the_slot_ints(impl, ids):
    with pytest.raises((ValueError, TypeError)):
        impl(ids)
