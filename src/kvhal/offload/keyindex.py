"""The offloading manager's key -> slot index: native when compiled, a dict otherwise.

``KeyIndex(ids)`` maps bytes keys to the slots ``0 .. len(ids) - 1``, at most
one key a slot, and returns slot ``s`` as the object ``ids[s]`` (the slot
pool's tuple of ints, so lookups allocate nothing): ``get(key)``,
``slots(keys)``, ``add(keys, slots)`` (all or nothing), ``remove(slots) ->
keys``, ``key(slot)``, ``len()``, ``in``. The native one (``_keyindex.c``)
costs 16-24 bytes a slot; this fallback, a dict plus a list, 62-113 (dict
tables grow to 3-6x their entries under churn) -- :data:`NATIVE` says which
one runs.

Keys are exact ``bytes`` in every call, lookups included: a subclass (whose
``__hash__`` or ``__eq__`` could run anything, the index's own calls among it,
in the middle of a probe) or any other type is a TypeError.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

__all__ = ["NATIVE", "KeyIndex"]


class PyKeyIndex:
    """The pure-Python index, same API as the native one."""

    def __init__(self, ids: tuple[int, ...]) -> None:
        if not isinstance(ids, tuple) or not 0 < len(ids) <= 2**30 - 1:
            raise ValueError("ids must be a tuple of 1 to 2**30 - 1 slot ids")
        if any(type(i) is not int or i != n for n, i in enumerate(ids)):
            raise ValueError("ids[s] must be the int s")
        self.num_slots = num_slots = len(ids)
        self._ids = ids
        self._slot_of: dict[bytes, int] = {}
        self._key_of: list[bytes | None] = [None] * num_slots

    def get(self, key: bytes) -> int | None:
        _check_key(key)
        return self._slot_of.get(key)

    def slots(self, keys: Iterable[bytes]) -> list[int | None]:
        keys = list(keys)
        for key in keys:
            _check_key(key)
        return list(map(self._slot_of.get, keys))

    def _check(self, slot: int) -> int:
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} is not in [0, {self.num_slots})")
        return slot

    def add(self, keys: Sequence[bytes], slots: Sequence[int]) -> None:
        if len(keys) != len(slots):
            raise ValueError("keys and slots differ in length")
        done = []
        try:
            for key, slot in zip(keys, slots, strict=True):
                _check_key(key)
                if self._key_of[self._check(slot)] is not None:
                    raise ValueError(f"slot {slot} is taken")
                if key in self._slot_of:
                    raise KeyError(f"key is already in slot {self._slot_of[key]}")
                self._slot_of[key] = self._ids[slot]
                self._key_of[slot] = key
                done.append(slot)
        except BaseException:
            self.remove(done)
            raise

    def remove(self, slots: Sequence[int]) -> list[bytes | None]:
        for slot in slots:
            if self._key_of[self._check(slot)] is None:
                raise KeyError(f"slot {slot} is empty")
        keys = []
        for slot in slots:
            key = self._key_of[slot]
            if key is not None:
                del self._slot_of[key]
                self._key_of[slot] = None
            keys.append(key)
        return keys

    def key(self, slot: int) -> bytes | None:
        return self._key_of[self._check(slot)]

    def __len__(self) -> int:
        return len(self._slot_of)

    def __contains__(self, key: object) -> bool:
        _check_key(key)
        return key in self._slot_of


def _check_key(key: object) -> None:
    if type(key) is not bytes:
        raise TypeError(f"keys are bytes (not a subclass), got {type(key).__name__}")


try:
    from kvhal.offload._keyindex import KeyIndex

    NATIVE = True
except ImportError:  # built without a C compiler
    KeyIndex = PyKeyIndex  # type: ignore[misc,assignment]
    NATIVE = False
