"""The offloading manager: which blocks the host tier holds, and which may be read.

kvhal's own API, stable whatever vLLM's manager API is (it changed twice in
2026): ``lookup``, ``prepare_load``/``complete_load``, ``touch``,
``prepare_store``/``complete_store``, ``take_events`` -- the primitives of
vLLM's first offloading manager (PR #20075). It runs where the engine
schedules (vLLM's scheduler process) and never touches KV bytes: it hands
out slots, and the :class:`~kvhal.transfer.TransferEngine` moves the bytes.

Keys are opaque ``bytes`` the manager never looks inside: a block hash plus
the KV cache group (vLLM 0.32's ``OffloadKey`` is the hash followed by the
group index in 4 bytes). Every group shares one pool of equal slots -- vLLM
makes page sizes equal across KV cache groups, so a block of a full-attention
group and one of a sliding-window group take one slot each -- and so groups
need no logic here beyond their keys being different.

A block is *storing* from ``prepare_store`` until ``complete_store``, then
*ready*; only ready blocks are found by ``lookup`` and loaded. Blocks being
stored or loaded are never evicted (vLLM PR #20075's race).

Not thread-safe: like vLLM's scheduler, one thread calls it.

Memory per tracked block (about 80 bytes; vLLM 0.32's manager takes about
500, BENCHMARKS.md): the key index, 16-24 bytes natively (:mod:`kvhal.keyindex`),
4 bytes of state (``array('i')``), the free list's 4 bytes and 1 taken byte,
and the policy's own (LRU: 8 bytes of links).
"""

from __future__ import annotations

import enum
import sys
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvhal.errors import BlockStateError, PolicyError, ValidationError
from kvhal.eviction import DEFAULT_POLICY, EvictionPolicy, create_policy
from kvhal.host_tier import SlotPool
from kvhal.keyindex import KeyIndex
from kvhal.registry import PluginRegistry

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
    """What :meth:`OffloadingManager.prepare_store` decided.

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


@dataclass(frozen=True, slots=True)
class OffloadEvent:
    """A change of what the host tier holds, for KV-event consumers.

    ``removed=False``: ``keys`` became loadable (a successful ``complete_store``).
    ``removed=True``: loadable ``keys`` left (evicted). A failed store makes no
    event: its keys were never announced, so a consumer has nothing to forget.
    """

    keys: list[bytes]
    removed: bool


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


class OffloadingManager:
    """Tracks offloaded blocks in a fixed number of equal host slots.

    :param slots: the slot count, or the :class:`~kvhal.host_tier.SlotPool`
        to allocate from (a :class:`~kvhal.host_tier.HostTier`'s ``pool``
        in a single process, so that the tier and the manager share one free list).
    :param policy: an eviction policy name (``"lru"``, ``"s3fifo"``, or one a
        plugin offers through ``kvhal_eviction_policies``) or a policy object.
    :param registry: where named policies are looked up (default: the
        installed plugins).
    :param enable_events: record :class:`OffloadEvent` for :meth:`take_events`.
    """

    def __init__(
        self,
        slots: int | SlotPool,
        policy: str | EvictionPolicy = DEFAULT_POLICY,
        *,
        registry: PluginRegistry | None = None,
        enable_events: bool = False,
    ) -> None:
        self._pool = slots if isinstance(slots, SlotPool) else SlotPool(slots)
        num_slots = self._pool.num_slots
        if self._pool.num_free != num_slots:
            raise ValidationError("slots", "the slot pool must be entirely free")
        if isinstance(policy, str):
            policy = create_policy(policy, num_slots, registry or PluginRegistry())
        elif not isinstance(policy, EvictionPolicy):
            raise ValidationError("policy", f"must be a name or an EvictionPolicy, got {policy!r:.60}")
        self.policy = policy
        self._index = KeyIndex(self._pool.ids)
        self._refs = [0] * num_slots  # a list: 8 bytes a slot, faster than array("i") here
        self._num_evictable = 0  # ready blocks without loads in flight
        self._num_storing = 0
        self._events: list[OffloadEvent] | None = [] if enable_events else None

    # -- state ---------------------------------------------------------------

    @property
    def pool(self) -> SlotPool:
        """The free list the manager allocates slots from."""
        return self._pool

    @property
    def num_slots(self) -> int:
        """Slots in all (each holds one block of one KV cache group)."""
        return self._pool.num_slots

    @property
    def num_free(self) -> int:
        """Slots holding nothing."""
        return self._pool.num_free

    @property
    def num_storing(self) -> int:
        """Blocks between ``prepare_store`` and ``complete_store``."""
        return self._num_storing

    @property
    def num_evictable(self) -> int:
        """Ready blocks with no load in flight: what eviction may take."""
        return self._num_evictable

    def __len__(self) -> int:
        """Blocks tracked: storing or ready."""
        return len(self._index)

    def state(self, key: bytes) -> BlockState:
        """Whether ``key`` is absent, being stored, or ready to load."""
        slot = self._index.get(key)
        if slot is None:
            return BlockState.ABSENT
        return BlockState.STORING if self._refs[slot] == STORING else BlockState.READY

    def loads_in_flight(self, key: bytes) -> int:
        """Loads of ``key`` prepared and not yet completed (0 for an unknown key)."""
        slot = self._index.get(key)
        return 0 if slot is None else max(self._refs[slot], 0)

    def slot(self, key: bytes) -> int | None:
        """The host slot holding ``key``, or ``None``."""
        return self._index.get(key)

    def _slots(self, keys: Iterable[bytes]) -> list[int | None]:
        """Each key's slot or None, in one call to the index."""
        _refuse_one_key(keys)
        try:
            return self._index.slots(keys)
        except TypeError as exc:  # an unhashable key, or keys not iterable
            raise ValidationError("keys", f"must be an iterable of bytes keys: {exc}") from None

    # -- loads ---------------------------------------------------------------

    def lookup(self, keys: Iterable[bytes]) -> int:
        """How many of ``keys``, from the first, are ready: the loadable prefix.

        A key that is unknown or still being stored ends the prefix.
        """
        # Whole-list C calls instead of a loop per key: the index answers for all keys.
        slots = self._slots(keys)
        try:
            hits = slots.index(None)
        except ValueError:
            hits = len(slots)
        states = list(map(self._refs.__getitem__, slots[:hits]))
        if states and min(states) < 0:
            hits = next(i for i, state in enumerate(states) if state < 0)
        return hits

    def _slots_of(self, keys: list[bytes], lowest: int, highest: int, needs: str) -> list[int]:
        """The slots of ``keys``, each of whose state ``_refs`` lies in ``[lowest, highest]``."""
        refs = self._refs
        slots = self._slots(keys)
        if not slots:
            return slots  # type: ignore[return-value]
        states = None if None in slots else list(map(refs.__getitem__, slots))
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
        slots = self._slots_of(keys, 0, sys.maxsize, "only ready blocks can be loaded")
        refs, pinned = self._refs, 0
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
        slots = self._slots_of(keys, 1, sys.maxsize, "complete_load needs a load in flight")
        refs = self._refs
        if len(set(slots)) != len(slots):
            for slot, count in Counter(slots).items():
                if refs[slot] < count:
                    key = self._index.key(slot)
                    raise BlockStateError(
                        "keys", f"{key!r:.60} listed {count} times, {refs[slot]} loads in flight"
                    )
        freed = 0
        for slot in slots:
            state = refs[slot] - 1
            refs[slot] = state
            if not state:
                freed += 1
        self._num_evictable += freed

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
        present = self._slots(keys)
        new = [key for key, slot in zip(keys, present, strict=True) if slot is None]
        if len(new) > 1:
            new = list(dict.fromkeys(new))
        if not all(map(bytes.__instancecheck__, new)):
            bad = next(key for key in new if not isinstance(key, bytes))
            raise ValidationError("keys", f"keys are bytes; got {type(bad).__name__} {bad!r:.40}")
        if not new:
            return StorePlan([], [], [])
        room = self._make_room(len(new) - self._pool.num_free, present)
        if room is None:
            return None
        evicted, victims = room
        slots = self._pool.allocate(len(new))
        assert slots is not None  # room was made
        self._index.add(new, slots)
        refs = self._refs
        for slot in slots:
            refs[slot] = STORING
        self.policy.insert(slots, new)
        self._num_storing += len(new)
        return StorePlan(new, slots, evicted, victims)

    def _make_room(
        self, need: int, present: list[int | None]
    ) -> tuple[list[bytes], list[int]] | None:
        """Evict ``need`` blocks, none of the call's own ``present`` ones: their keys and
        slots; None if impossible."""
        if need <= 0:
            return [], []
        refs = self._refs
        # The call's own tracked blocks stay (vLLM does the same): pin them for the policy.
        own = {slot for slot in present if slot is not None and refs[slot] == 0}
        if need > self._num_evictable - len(own):
            return None
        for slot in own:
            refs[slot] = 1
        try:
            victims = self.policy.evict(need, refs)
        finally:
            for slot in own:
                refs[slot] = 0
        self._check_victims(victims, need)
        evicted = self._index.remove(victims)
        self._pool._release(victims)
        self._num_evictable -= need
        if self._events is not None:
            self._events.append(OffloadEvent(evicted, removed=True))  # type: ignore[arg-type]
        return evicted, list(victims)  # type: ignore[return-value]

    def _check_victims(self, victims: list[int], need: int) -> None:
        """A policy that evicts a block in use would let a copy overwrite it: refuse."""
        if len(victims) != need or len(set(victims)) != need:
            raise PolicyError(f"evict({need}) returned {len(victims)} slots, {len(set(victims))} distinct")
        if (
            min(victims) < 0
            or max(victims) >= self.num_slots
            or any(map(self._refs.__getitem__, victims))
            or not self._pool.are_taken(victims)
        ):
            raise PolicyError(f"evict() chose a slot that is free, pinned or out of range: {victims[:8]}")

    def complete_store(self, keys: Iterable[bytes], success: bool = True) -> None:
        """Finish the stores of ``keys``: ready to load, or (``success=False``) dropped
        and their slots freed -- a failed store never becomes loadable.

        :raises BlockStateError: a key is not being stored (unknown, or completed
            already) or is listed twice (nothing changed).
        """
        keys = _as_list(keys)
        slots = self._slots_of(keys, STORING, STORING, "complete_store needs a store in flight")
        if len(set(slots)) != len(slots):
            raise BlockStateError("keys", "a key is listed twice; each store completes once")
        refs = self._refs
        for slot in slots:
            refs[slot] = 0
        self._num_storing -= len(slots)
        if success:
            self._num_evictable += len(slots)
        else:
            self._index.remove(slots)
            self.policy.remove(slots)
            self._pool._release(slots)
        if self._events is not None and keys and success:
            self._events.append(OffloadEvent(list(keys), removed=False))

    # -- events --------------------------------------------------------------

    def take_events(self) -> list[OffloadEvent]:
        """The events since the last call (empty unless ``enable_events``)."""
        if not self._events:
            return []
        events, self._events = self._events, []
        return events
