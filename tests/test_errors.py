"""kvhal's error taxonomy: what a caller can catch, and the one integer check."""

from __future__ import annotations

import inspect

import pytest

import kvhal
from kvhal import errors
from kvhal.errors import BlockStateError, ClosedError, ValidationError, check_int


def test_every_error_type_is_exported_from_kvhal():
    defined = {
        name
        for name, obj in vars(errors).items()
        if inspect.isclass(obj) and issubclass(obj, errors.KVHALError) and obj.__module__ == errors.__name__
    }
    assert defined <= set(kvhal.__all__)
    assert all(getattr(kvhal, name) is getattr(errors, name) for name in defined)


def test_a_block_state_is_not_a_bad_value():
    error = BlockStateError("keys", "b'k' is still being stored")
    assert isinstance(error, kvhal.KVHALError)
    assert not isinstance(error, ValueError) and not isinstance(error, ValidationError)
    assert error.argument == "keys" and str(error) == "keys: b'k' is still being stored"


def test_a_closed_host_tier_says_so(cpu):
    from kvhal.offload.host_tier import HostTier

    tier = HostTier(cpu, 8192, 4096)
    tier.close()
    with pytest.raises(ClosedError, match="the host tier is closed") as info:
        _ = tier.is_pinned
    assert not isinstance(info.value, ValidationError)


@pytest.mark.parametrize("value", [0, -1, 2.0, True, False, "3", None])
def test_check_int_refuses_what_is_not_a_positive_int(value):
    with pytest.raises(ValidationError, match=r"^slots: must be a positive int, got") as info:
        check_int("slots", value)
    assert info.value.argument == "slots"


def test_check_int_bounds_and_messages():
    assert check_int("n", 0, minimum=0) == 0
    assert check_int("p", -5, minimum=None) == -5
    assert check_int("slot", 3, minimum=0, below=4) == 3
    with pytest.raises(ValidationError, match=r"slot: 4 is not in \[0, 4\)"):
        check_int("slot", 4, minimum=0, below=4)
    with pytest.raises(ValidationError, match=r"n: must be an int >= 0, got -1"):
        check_int("n", -1, minimum=0)
    with pytest.raises(ValidationError, match=r"ids: slot 9 is past the end"):
        check_int("ids", 9, below=4, message="slot {value!r} is past the end")
