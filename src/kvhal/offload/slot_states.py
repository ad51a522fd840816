"""The state machine of a tier's slots, shared by the host tier's manager and the lower tiers' index.

:class:`SlotStates` holds, per slot, whether its block is being stored or ready and
how many loads are in flight, keeps the counts eviction relies on, and implements
``lookup``, ``prepare_load`` / ``complete_load``, ``touch`` and ``prepare_store`` /
``complete_store`` once. A subclass says how keys map to slots (its index, its free
slots, where the states are kept): :class:`~kvhal.offload.manager.OffloadingManager` keeps
the keys and a list, for speed; :class:`~kvhal.tiers.index.TierIndex` keeps 64-bit
hashes and numpy arrays, for memory.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Callable, Iterable, MutableSequence, Sequence
from dataclasses import dataclass, field

from kvhal.errors import BlockStateError, PolicyError, ValidationError
from kvhal.offload.eviction import EvictionPolicy

__all__ = ["STORING", "BlockState", "SlotStates", "StorePlan"]

#: ``_refs[slot]`` of a block whose store is in flight; ``0`` is ready and
#: idle, ``k > 0`` is ready with ``k`` loads in flight.
STORING = -1


class BlockState(str, enum.Enum):
    """Where a key stands in a manager."""

    ABSENT = "absent"
    STORING = "storing"
    READY = "ready"


@dataclass(frozen=True, slots=True)
class StorePlan:
    """What :meth:`OffloadingManager.prepare_store <kvhal.offload.manager.OffloadingManager.prepare_store>`
    decided.

    :param keys: the keys to store, in the order given (already present ones skipped).
    :param slots: the host slot of each key in ``keys``.
    :param evicted: keys evicted to make room; they are no longer loadable.
    :param evicted_slots: the slot each of ``evicted`` held (now among ``slots``):
        a write-back tier copies them out before the new blocks land.
    """

    keys: list[bytes]
    slots: list[int]
    evicted: list[bytes]
    evicted_slots: list[int] = field(default_factory=list)


#: Types that are one key, not a sequence of keys (iterating bytes yields ints).
_ONE_KEY = (bytes, bytearray, memoryview, str)


def _refuse_one_key(keys: object) -> None:
    if isinstance(keys, _ONE_KEY):
        raise ValidationError(
            "keys",
            f"must be a sequence of keys, got a single {type(keys).__name__} {keys!r:.40}; pass [key]",
        )


def _as_list(keys: Iterable[bytes]) -> list[bytes]:
    if isinstance(keys, list):
        return keys
    _refuse_one_key(keys)
    return list(keys)


class SlotStates:
    """Per-slot states (:data:`STORING`, ready idle, loads in flight) and the calls that change them.

    A subclass sets ``policy``, ``_refs`` (the states, given to the policy's ``evict``),
    ``_ref_at`` (the same states read and written one at a time as Python ints; may be
    ``_refs`` itself) and ``_max_loads``, zeroes ``_num_storing`` and ``_num_evictable``,
    and supplies the primitives below: how keys find their slots, how new keys enter the
    index and leave it, and the free slots.
    """

    policy: EvictionPolicy
    _refs: Sequence[int]
    _ref_at: MutableSequence[int]
    _max_loads: int  # the most loads of one block in flight
    _num_storing: int
    _num_evictable: int
    #: ``_keyindex.add_refs`` where ``_ref_at`` is a list of ints (the manager, built with a C
    #: compiler): a pass over a call's slots in one C call, the Python checks only on a refusal
    _add_refs: Callable[..., int] | None = None

    # -- what a subclass supplies -------------------------------------------

    @property
    def num_slots(self) -> int:
        raise NotImplementedError

    @property
    def num_free(self) -> int:
        raise NotImplementedError

    def slot(self, key: bytes) -> int | None:
        raise NotImplementedError

    def _slots(self, keys: Iterable[bytes]) -> list[int | None]:
        """Each key's slot or None (validating ``keys``)."""
        raise NotImplementedError

    def _new_keys(self, keys: list[bytes]) -> tuple[list[int | None], list[bytes], list]:
        """For ``prepare_store``: each key's slot or None, the new keys once each, and
        what :meth:`_index_add` takes for them."""
        raise NotImplementedError

    def _allocate(self, n: int) -> list[int]:
        """Take ``n`` free slots (there are)."""
        raise NotImplementedError

    def _index_add(self, entries: list, slots: list[int]) -> None:
        raise NotImplementedError

    def _index_remove(self, slots: list[int]) -> list[bytes] | None:
        """Take ``slots`` out of the index: their keys, if the index keeps them."""
        raise NotImplementedError

    def _release(self, slots: list[int]) -> None:
        """Free ``slots`` (out of the index already)."""
        raise NotImplementedError

    def _are_taken(self, slots: list[int]) -> bool:
        raise NotImplementedError

    def _stored(self, keys: list[bytes]) -> None:
        """``keys`` became loadable (a successful ``complete_store``)."""

    def _plan(
        self, keys: list[bytes], slots: list[int], evicted: list[bytes] | None, victims: list[int]
    ) -> StorePlan:
        """The :class:`StorePlan` of ``prepare_store``."""
        raise NotImplementedError

    # -- state ---------------------------------------------------------------

    @property
    def num_storing(self) -> int:
        """Blocks between ``prepare_store`` and ``complete_store``."""
        return self._num_storing

    @property
    def num_evictable(self) -> int:
        """Ready blocks with no load in flight: what eviction may take."""
        return self._num_evictable

    def state(self, key: bytes) -> BlockState:
        """Whether ``key`` is absent, being stored, or ready to load."""
        slot = self.slot(key)
        if slot is None:
            return BlockState.ABSENT
        return BlockState.STORING if self._ref_at[slot] == STORING else BlockState.READY

    def loads_in_flight(self, key: bytes) -> int:
        """Loads of ``key`` prepared and not yet completed (0 for an unknown key)."""
        slot = self.slot(key)
        return 0 if slot is None else max(self._ref_at[slot], 0)

    # -- loads ---------------------------------------------------------------

    def lookup(self, keys: Iterable[bytes]) -> int:
        """How many of ``keys``, from the first, are ready: the loadable prefix.

        A key that is unknown or still being stored ends the prefix.
        """
        # Whole-list calls instead of a loop per key.
        slots = self._slots(keys)
        try:
            hits = slots.index(None)
        except ValueError:
            hits = len(slots)
        states = list(map(self._ref_at.__getitem__, slots[:hits]))
        if states and min(states) < 0:
            hits = next(i for i, state in enumerate(states) if state < 0)
        return hits

    def _slots_of(self, keys: list[bytes], lowest: int, highest: int, needs: str) -> list[int]:
        """The slots of ``keys``, each of whose state lies in ``[lowest, highest]``."""
        refs = self._ref_at
        slots = self._slots(keys)
        if not slots:
            return slots  # type: ignore[return-value]
        try:
            states = list(map(refs.__getitem__, slots))
        except TypeError:  # a key without a slot (None)
            states = None
        if states is None or min(states) < lowest or max(states) > highest:
            for key, slot in zip(keys, slots, strict=True):
                if slot is None or not lowest <= refs[slot] <= highest:
                    if slot is None:
                        state = "not offloaded"
                    elif refs[slot] == STORING:
                        state = "still being stored"
                    else:
                        state = f"ready with {refs[slot]} loads in flight"
                    raise BlockStateError("keys", f"{key!r:.60} is {state}; {needs}")
        return slots  # type: ignore[return-value]

    def prepare_load(self, keys: Iterable[bytes]) -> list[int]:
        """Protect ready ``keys`` from eviction until :meth:`complete_load`; their slots.

        Counted per call: two loads of a key need two ``complete_load`` calls.

        :raises BlockStateError: a key is absent or still being stored (nothing changed).
        """
        keys = _as_list(keys)
        if self._add_refs is not None:
            slots = self._slots(keys)
            pinned = self._add_refs(self._ref_at, slots, 1, 0, self._max_loads - len(keys))
            if pinned >= 0:
                self._num_evictable -= pinned
                return slots  # type: ignore[return-value]
            # refused, nothing changed: the checks below say why
        slots = self._slots_of(keys, 0, self._max_loads - len(keys), "only ready blocks can be loaded")
        refs, pinned = self._ref_at, 0
        for slot in slots:
            state = refs[slot]
            refs[slot] = state + 1
            if not state:
                pinned += 1
        self._num_evictable -= pinned
        return slots

    def complete_load(self, keys: Iterable[bytes]) -> None:
        """End one load of each of ``keys`` (successful or not): they may be evicted again.

        :raises BlockStateError: a key has no load in flight (nothing changed).
        """
        keys = _as_list(keys)
        if self._add_refs is not None:
            freed = self._add_refs(self._ref_at, self._slots(keys), -1, 1, self._max_loads)
            if freed >= 0:
                self._num_evictable += freed
                return
        slots = self._slots_of(keys, 1, self._max_loads, "complete_load needs a load in flight")
        refs = self._ref_at
        if len(set(slots)) != len(slots):
            key_of = dict(zip(slots, keys, strict=True))
            for slot, count in Counter(slots).items():
                if refs[slot] < count:
                    raise BlockStateError(
                        "keys", f"{key_of[slot]!r:.60} listed {count} times, {refs[slot]} loads in flight"
                    )
        freed = 0
        for slot in slots:
            state = refs[slot] - 1
            refs[slot] = state
            if not state:
                freed += 1
        self._num_evictable += freed

    def touch_slots(self, slots: Sequence[int]) -> None:
        """:meth:`touch` of the keys in ``slots`` (slots a load or a store holds: no lookup)."""
        if slots:
            self.policy.touch(slots)

    def touch(self, keys: Iterable[bytes]) -> None:
        """Mark ``keys`` used, the first most recently (a prefix's head outlives its tail).

        Unknown keys are ignored (documented no-op): a request touches all its
        blocks, offloaded or not.
        """
        slots = [slot for slot in self._slots(keys) if slot is not None]
        if slots:
            self.policy.touch(slots)

    # -- stores --------------------------------------------------------------

    def prepare_store(self, keys: Iterable[bytes]) -> StorePlan | None:
        """Choose slots for the ``keys`` not yet tracked, evicting if needed.

        Keys already tracked (storing or ready) are skipped, and are not
        evicted to make room for the others. The stored keys are protected
        until :meth:`complete_store`.

        :return: the keys to store, their slots and the evicted keys; ``None``
            (nothing changed) if not enough blocks can be evicted -- every
            other one is being stored or loaded.
        :raises ValidationError: a new key is not ``bytes`` (nothing changed).
        """
        keys = _as_list(keys)
        present, new, entries = self._new_keys(keys)
        if not new:
            return StorePlan([], [], [])
        room = self._make_room(len(new) - self.num_free, present)
        if room is None:
            return None
        slots = self._allocate(len(new))
        self._index_add(entries, slots)
        refs = self._ref_at
        for slot in slots:
            refs[slot] = STORING
        self.policy.insert(slots, new)
        self._num_storing += len(new)
        return self._plan(new, slots, *room)

    def _make_room(self, need: int, present: list[int | None]) -> tuple[list[bytes] | None, list[int]] | None:
        """Evict ``need`` blocks, none of the call's own ``present`` ones: their keys (if the
        index keeps them) and slots; None if impossible."""
        if need <= 0:
            return [], []
        refs = self._ref_at
        # The call's own tracked blocks stay (vLLM does the same): pin them for the policy.
        own = {slot for slot in present if slot is not None and refs[slot] == 0}
        if need > self._num_evictable - len(own):
            return None
        for slot in own:
            refs[slot] = 1
        try:
            victims = self.policy.evict(need, self._refs)
        finally:
            for slot in own:
                refs[slot] = 0
        victims = list(map(int, victims))  # numpy ints from a policy given numpy states
        self._check_victims(victims, need)
        evicted = self._index_remove(victims)
        self._release(victims)
        self._num_evictable -= need
        return evicted, victims

    def _check_victims(self, victims: list[int], need: int) -> None:
        """A policy that evicts a block in use would let a copy overwrite it: refuse."""
        if len(victims) != need or len(set(victims)) != need:
            raise PolicyError(f"evict({need}) returned {len(victims)} slots, {len(set(victims))} distinct")
        if (
            min(victims) < 0
            or max(victims) >= self.num_slots
            or any(map(self._ref_at.__getitem__, victims))
            or not self._are_taken(victims)
        ):
            raise PolicyError(f"evict() chose a slot that is free, pinned or out of range: {victims[:8]}")

    def complete_store(self, keys: Iterable[bytes], success: bool = True) -> None:
        """Finish the stores of ``keys``: ready to load, or (``success=False``) dropped
        and their slots freed -- a failed store never becomes loadable.

        :raises BlockStateError: a key is not being stored (unknown, or completed
            already) or is listed twice (nothing changed).
        """
        keys = _as_list(keys)
        slots = None
        if self._add_refs is not None:
            slots = self._slots(keys)
            if self._add_refs(self._ref_at, slots, 1, STORING, STORING) < 0:  # to 0; refused: unchanged
                slots = None
        if slots is None:
            slots = self._slots_of(keys, STORING, STORING, "complete_store needs a store in flight")
            if len(set(slots)) != len(slots):
                raise BlockStateError("keys", "a key is listed twice; each store completes once")
            refs = self._ref_at
            for slot in slots:
                refs[slot] = 0
        self._num_storing -= len(slots)
        if success:
            self._num_evictable += len(slots)
            self._stored(keys)
        elif slots:
            self._index_remove(slots)
            self.policy.remove(slots)
            self._release(slots)
