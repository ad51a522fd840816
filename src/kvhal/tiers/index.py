"""The index of a tier below host memory: which keys a disk (or other) tier holds, compactly.

A tier below the host tier holds far more blocks than RAM (10 TB of 64 KiB
blocks is 160M blocks), and its index lives in the scheduler process.
:class:`TierIndex` has the API and the semantics of
:class:`~kvhal.offload.manager.OffloadingManager` -- ``lookup``, ``prepare_load`` /
``complete_load``, ``touch``, ``prepare_store`` / ``complete_store``,
``state``, ``slot`` -- so that the tier chain drives both alike, plus
:meth:`TierIndex.forget` (a read found a block missing or corrupt) and
:meth:`TierIndex.recover` (a bulk load of what the medium holds after a restart).

It does not keep the keys, to cost about 20 bytes a block with the ``clock``
policy (the host tier's manager, about 80): per slot the key's 64-bit
xxh3 hash (8 bytes), the slot's state (2 bytes), its place in the free
stack (4 bytes) and the policy's byte; plus an open-addressing table of slot
ids (linear probing, at most 70% full: about 6 bytes a slot).

A consequence: two live keys whose 64-bit hashes are equal look like one.
The second is then believed present (``lookup`` finds it, ``prepare_store``
skips it) while the tier holds the first. That costs a recompute, never wrong
KV: the tier verifies every block's full key when it reads it
(:meth:`kvhal.tiers.backend.TierBackend.read` answers
:data:`~kvhal.tiers.backend.MISSING`), and the chain then calls
:meth:`TierIndex.forget`. For the same reason :attr:`StorePlan.evicted
<kvhal.offload.manager.StorePlan>` holds the evicted *slots*, not keys.

Not thread-safe: one thread (the scheduler's) calls it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import xxhash

from kvhal.errors import BlockStateError, ValidationError
from kvhal.offload.eviction import EvictionPolicy, create_policy
from kvhal.offload.slot_states import STORING, SlotStates, StorePlan, _as_list, _refuse_one_key
from kvhal.registry import PluginRegistry

__all__ = ["LOAD_FACTOR", "TierIndex"]

#: The most the slot table is filled (when every slot holds a block).
LOAD_FACTOR = 0.7
_EMPTY = -1  # a free place in the table


class TierIndex(SlotStates):
    """Which keys a tier of ``num_slots`` equal slots holds, at about 20 bytes a block.

    :param num_slots: the tier's slot count.
    :param policy: an eviction policy name (``"clock"``, ``"lru"``, ``"s3fifo"``, or
        one a plugin offers) or a policy object for ``num_slots`` slots.
    :param registry: where named policies are looked up (default: the installed plugins).

    A block is *storing* from :meth:`prepare_store` until :meth:`complete_store`,
    then *ready*; blocks being stored or loaded are never evicted. Keys are
    ``bytes``; a key is known by its 64-bit hash (see the module docstring).
    """

    #: ``key -> 64-bit unsigned hash``; tests replace it to provoke collisions.
    key_hash: Callable[[bytes], int] = staticmethod(xxhash.xxh3_64_intdigest)
    _max_loads = int(np.iinfo(np.int16).max)  # what an int16 state counts

    def __init__(
        self,
        num_slots: int,
        policy: str | EvictionPolicy = "clock",
        *,
        registry: PluginRegistry | None = None,
    ) -> None:
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
            raise ValidationError("num_slots", f"must be a positive int, got {num_slots!r:.40}")
        if isinstance(policy, str):
            policy = create_policy(policy, num_slots, registry or PluginRegistry())
        elif not isinstance(policy, EvictionPolicy):
            raise ValidationError("policy", f"must be a name or an EvictionPolicy, got {policy!r:.60}")
        if policy.num_slots != num_slots:
            raise ValidationError("policy", f"is for {policy.num_slots} slots, not {num_slots}")
        self.policy = policy
        self._num_slots = num_slots
        # Sized once for a full tier: no resize ever (backward-shift deletion leaves no tombstones).
        self._capacity = max(8, math.ceil(num_slots / LOAD_FACTOR))
        self._divisor = -(-(1 << 64) // self._capacity)  # a hash's home: hash // divisor
        self._hashes = np.zeros(num_slots, dtype=np.uint64)  # 0: the slot holds nothing
        self._table = np.full(self._capacity, _EMPTY, dtype=np.int32)
        self._refs = np.zeros(num_slots, dtype=np.int16)  # STORING, or loads in flight
        self._free = np.arange(num_slots - 1, -1, -1, dtype=np.int32)  # a stack: pops 0, 1, 2...
        self._num_free = num_slots
        self._num_evictable = 0
        self._num_storing = 0
        self._views()

    def _views(self) -> None:
        # memoryviews read and write single elements as Python ints, 3-4x faster than numpy scalars.
        self._hash_at = memoryview(self._hashes)
        self._slot_at = memoryview(self._table)
        self._ref_at = memoryview(self._refs)

    # -- state ---------------------------------------------------------------

    @property
    def num_slots(self) -> int:
        """Slots in all."""
        return self._num_slots

    @property
    def num_free(self) -> int:
        """Slots holding nothing."""
        return self._num_free

    def __len__(self) -> int:
        """Blocks tracked: storing or ready."""
        return self._num_slots - self._num_free

    def slot(self, key: bytes) -> int | None:
        """The slot holding ``key``, or ``None``."""
        return self._find(self._hash(key))

    # -- the hash table ------------------------------------------------------

    def _hash(self, key: bytes) -> int:
        if not isinstance(key, bytes):
            raise ValidationError("keys", f"keys are bytes; got {type(key).__name__} {key!r:.40}")
        return self.key_hash(key) or 1  # 0 marks an empty slot

    def _hashes_of(self, keys: Iterable[bytes]) -> list[int]:
        _refuse_one_key(keys)
        try:
            keys = list(keys)
        except TypeError as exc:
            raise ValidationError("keys", f"must be an iterable of bytes keys: {exc}") from None
        if not all(map(bytes.__instancecheck__, keys)):
            bad = next(key for key in keys if not isinstance(key, bytes))
            raise ValidationError("keys", f"keys are bytes; got {type(bad).__name__} {bad!r:.40}")
        key_hash = self.key_hash
        return [key_hash(key) or 1 for key in keys]

    # The table is Robin Hood linear probing: along a run of taken places the
    # entries lie in the order of their hashes (of their homes, a hash's home
    # being ``hash // divisor``, monotonic). A probe passes smaller hashes and
    # stops at the first entry that would lie after the key sought, so misses
    # cost about as much as hits, and the newest keys are found as fast as old
    # ones. Sorted by hash, recover() builds the table in bulk.

    def _find(self, h: int) -> int | None:
        """The slot whose hash is ``h``, or None."""
        return self._finds([h])[0]

    def _finds(self, hashes: list[int]) -> list[int | None]:
        """The slot of each hash, or None (the loop of every call, inlined)."""
        table, at, capacity, divisor = self._slot_at, self._hash_at, self._capacity, self._divisor
        slots = []
        for h in hashes:
            i = home = h // divisor
            slot = table[i]
            while slot >= 0:
                other = at[slot]
                if other == h:
                    break
                # Past a smaller hash, go on (a run wrapping past the table's end holds
                # larger hashes before smaller ones: going on is always safe, just slower).
                if other > h and (i - other // divisor) % capacity <= (i - home) % capacity:
                    slot = None  # ``other`` lies after where ``h`` would
                    break
                i += 1
                if i == capacity:
                    i = 0
                slot = table[i]
            else:  # an empty place: absent
                slot = None
            slots.append(slot)
        return slots

    def _add(self, slot: int, h: int) -> None:
        """Put ``slot`` (hash ``h``, absent) in the table before the entries that follow it."""
        table, at, capacity, divisor = self._slot_at, self._hash_at, self._capacity, self._divisor
        at[slot] = h
        i = h // divisor
        distance = 0
        while True:
            other = table[i]
            if other < 0:
                table[i] = slot
                return
            other_h = at[other]
            other_distance = (i - other_h // divisor) % capacity
            if other_distance < distance or (other_distance == distance and other_h > h):
                table[i] = slot  # take its place, carry it on
                slot, h, distance = other, other_h, other_distance
            i += 1
            distance += 1
            if i == capacity:
                i = 0

    def _delete(self, slot: int) -> None:
        """Take ``slot`` out of the table, shifting the displaced entries after it back."""
        table, at, capacity, divisor = self._slot_at, self._hash_at, self._capacity, self._divisor
        hole = at[slot] // divisor
        while table[hole] != slot:
            hole += 1
            if hole == capacity:
                hole = 0
        at[slot] = 0
        while True:
            i = hole + 1
            if i == capacity:
                i = 0
            moved = table[i]
            if moved < 0 or at[moved] // divisor == i:  # empty, or at home
                break
            table[hole] = moved
            hole = i
        table[hole] = _EMPTY

    def _release(self, slots: Sequence[int]) -> None:
        """Free ``slots`` (out of the table already), to be allocated lowest first."""
        n = len(slots)
        top = self._num_free
        self._free[top : top + n] = sorted(slots, reverse=True)
        self._num_free = top + n

    # -- the table as SlotStates asks of a tier -------------------------------

    def _slots(self, keys: Iterable[bytes]) -> list[int | None]:
        return self._finds(self._hashes_of(keys))

    def _new_keys(self, keys: list[bytes]) -> tuple[list[int | None], list[bytes], list[int]]:
        hashes = self._hashes_of(keys)
        present = self._finds(hashes)
        new: dict[int, bytes] = {}  # hash -> key: a repeated key (or hash) is stored once
        for key, h, slot in zip(keys, hashes, present, strict=True):
            if slot is None and h not in new:
                new[h] = key
        return present, list(new.values()), list(new)

    def _allocate(self, n: int) -> list[int]:
        top = self._num_free - n
        slots = self._free[top : top + n][::-1].tolist()
        self._num_free = top
        return slots

    def _index_add(self, entries: list[int], slots: list[int]) -> None:
        for slot, h in zip(slots, entries, strict=True):
            self._add(slot, h)

    def _index_remove(self, slots: list[int]) -> None:
        for slot in slots:
            self._delete(slot)

    def _are_taken(self, slots: list[int]) -> bool:
        return all(map(self._hash_at.__getitem__, slots))

    def _plan(self, keys: list[bytes], slots: list[int], evicted: None, victims: list[int]) -> StorePlan:
        return StorePlan(keys, slots, victims)  # type: ignore[arg-type]

    # -- loads and stores (the state machine is SlotStates') ----------------------

    def prepare_load(self, keys: Iterable[bytes]) -> list[int]:
        """Protect ready ``keys`` from eviction until :meth:`complete_load`; their slots.

        Counted per call: two loads of a key need two ``complete_load`` calls.

        :raises BlockStateError: a key is absent, still being stored, or has
            32767 loads in flight (nothing changed).
        """
        return super().prepare_load(keys)

    def prepare_store(self, keys: Iterable[bytes]) -> StorePlan | None:
        """Choose slots for the ``keys`` not yet tracked, evicting if needed.

        Keys already tracked (storing or ready) are skipped, and are not
        evicted to make room for the others. The stored keys are protected
        until :meth:`complete_store`.

        :return: the keys to store, their slots and the evicted *slots*;
            ``None`` (nothing changed) if not enough blocks can be evicted.
        :raises ValidationError: a key is not ``bytes`` (nothing changed).
        """
        return super().prepare_store(keys)

    def forget(self, keys: Iterable[bytes]) -> None:
        """Drop ready ``keys``: a read found their blocks missing or corrupt.

        Unknown keys are ignored. Their slots are free again.

        :raises BlockStateError: a key is being stored or has a load in flight
            (complete the load first; nothing changed).
        """
        keys = _as_list(keys)
        slots = self._slots(keys)
        refs = self._ref_at
        for key, slot in zip(keys, slots, strict=True):
            if slot is not None and refs[slot]:
                state = "still being stored" if refs[slot] == STORING else f"{refs[slot]} loads in flight"
                raise BlockStateError("keys", f"{key!r:.60} has {state}; only idle blocks are forgotten")
        forgotten = list(dict.fromkeys(slot for slot in slots if slot is not None))
        if not forgotten:
            return
        self._index_remove(forgotten)
        self.policy.remove(forgotten)
        self._release(forgotten)
        self._num_evictable -= len(forgotten)

    # -- recovery ------------------------------------------------------------

    def recover(self, slots: Sequence[int] | np.ndarray, keys: Sequence[bytes]) -> int:
        """Index the blocks a medium holds after a restart: ``keys[i]`` is ready in ``slots[i]``.

        For an empty index, in bulk (about a second per few million blocks:
        numpy does the table, Python only hashes the keys). The policy gets
        them in the order given, as a numpy array of slots. A key listed twice
        (or two keys of one hash) is indexed once, in one of its slots; the
        others stay free.

        :return: the blocks indexed.
        :raises ValidationError: ``slots`` and ``keys`` differ in length, a slot
            is out of range or listed twice, or a key is not ``bytes``.
        :raises BlockStateError: the index is not empty.
        """
        if len(self):
            raise BlockStateError("slots", f"recover needs an empty index; {len(self)} blocks are tracked")
        _refuse_one_key(keys)
        ids = np.asarray(slots)
        if ids.ndim != 1 or len(ids) != len(keys):
            raise ValidationError("slots", f"{ids.shape} slots for {len(keys)} keys; one slot per key")
        n = len(ids)
        if not n:
            return 0
        if ids.dtype.kind not in "iu":
            raise ValidationError("slots", f"slot ids are ints, got {ids.dtype}")
        if ids.min() < 0 or ids.max() >= self._num_slots:
            raise ValidationError("slots", f"a slot is not in [0, {self._num_slots})")
        ids = ids.astype(np.intp)
        seen = np.zeros(self._num_slots, dtype=bool)
        seen[ids] = True
        if np.count_nonzero(seen) != n:
            raise ValidationError("slots", "a slot is listed twice")
        del seen
        if not all(map(bytes.__instancecheck__, keys)):
            bad = next(key for key in keys if not isinstance(key, bytes))
            raise ValidationError("keys", f"keys are bytes; got {type(bad).__name__} {bad!r:.40}")
        hashes = np.fromiter(map(self.key_hash, keys), dtype=np.uint64, count=n)
        hashes[hashes == 0] = 1  # 0 marks an empty slot
        self._hashes[ids] = hashes
        kept = self._build_table(ids, hashes)
        if kept is not None:  # duplicates: their slots stay free
            self._hashes[ids[~kept]] = 0
            ids = ids[kept]
            keys = [key for key, keep in zip(keys, kept.tolist(), strict=True) if keep]
        free = np.flatnonzero(self._hashes == 0)[::-1].astype(np.int32)
        self._free[: len(free)] = free
        self._num_free = len(free)
        self._num_evictable = len(ids)
        self.policy.insert(ids, keys)
        return len(ids)

    def _build_table(self, ids: np.ndarray, hashes: np.ndarray) -> np.ndarray | None:
        """Fill the empty table with every ``(slot, hash)`` at once; which were kept, or None if all.

        Sorted by hash, the entries are in the order of their homes; each lies
        at its home or just after the one before it (a running maximum). The
        entries pushed past the table's end wrap to its start, before the
        entries homed there. Of equal hashes the first given is kept.
        """
        capacity = self._capacity
        order = np.argsort(hashes, kind="stable")
        ordered = hashes[order]
        kept = None
        repeated = ordered[1:] == ordered[:-1]
        if repeated.any():
            kept = np.ones(len(ids), dtype=bool)
            kept[order[1:][repeated]] = False
            unique = np.concatenate(([True], ~repeated))
            order, ordered = order[unique], ordered[unique]
        home = (ordered // np.uint64(self._divisor)).astype(np.int64)
        place = _run_places(home)
        wrapped = 0
        while place[-1] >= capacity:  # the last entries wrap: place them first, then the rest
            wrapped = len(place) - int(np.searchsorted(place, capacity))
            order = np.roll(order, wrapped)
            home = np.concatenate((place[-wrapped:] - capacity, home[:-wrapped]))
            place = _run_places(home)
        self._table[place] = ids[order]
        return kept


def _run_places(home: np.ndarray) -> np.ndarray:
    """Where entries sorted by ``home`` lie: at home, or right after the entry before."""
    step = np.arange(len(home), dtype=np.int64)
    return np.maximum.accumulate(home - step) + step
