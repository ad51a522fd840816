"""The offloading manager: which blocks the host tier holds, and which may be read.

kvhal's own API, stable whatever vLLM's manager API is (it changed twice in
2026): ``lookup``, ``prepare_load``/``complete_load``, ``touch``,
``prepare_store``/``complete_store``, ``take_events`` -- the primitives of
vLLM's first offloading manager (PR #20075). It runs where the engine
schedules (vLLM's scheduler process) and never touches KV bytes: it hands
out slots, and the :class:`~kvhal.offload.transfer.TransferEngine` moves the bytes.

Keys are opaque ``bytes`` the manager never looks inside: a block hash plus
the KV cache group (vLLM 0.32's ``OffloadKey`` is the hash followed by the
group index in 4 bytes). Every group shares one pool of equal slots -- vLLM
makes page sizes equal across KV cache groups, so a block of a full-attention
group and one of a sliding-window group take one slot each -- and so groups
need no logic here beyond their keys being different.

A block is *storing* from ``prepare_store`` until ``complete_store``, then
*ready*; only ready blocks are found by ``lookup`` and loaded. Blocks being
stored or loaded are never evicted (vLLM PR #20075's race). The states and
their checks are :class:`~kvhal.offload.slot_states.SlotStates`, shared with the lower
tiers' :class:`~kvhal.tiers.index.TierIndex`.

Not thread-safe: like vLLM's scheduler, one thread calls it.

Memory per tracked block (about 80 bytes; vLLM 0.32's manager takes about
500, BENCHMARKS.md): the key index, 16-24 bytes natively (:mod:`kvhal.offload.keyindex`),
4 bytes of state (``array('i')``), the free list's 4 bytes and 1 taken byte,
and the policy's own (LRU: 8 bytes of links).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import dataclass

from kvhal.errors import ValidationError
from kvhal.offload.eviction import DEFAULT_POLICY, EvictionPolicy, create_policy
from kvhal.offload.host_tier import SlotPool
from kvhal.offload.keyindex import NATIVE, KeyIndex
from kvhal.offload.slot_states import STORING, BlockState, SlotStates, StorePlan, _as_list, _refuse_one_key
from kvhal.registry import PluginRegistry

try:
    from kvhal.offload._keyindex import add_refs as _native_add_refs
except ImportError:  # built without a C compiler: SlotStates' Python loops
    _native_add_refs = None

__all__ = ["STORING", "BlockState", "OffloadEvent", "OffloadingManager", "StorePlan"]


@dataclass(frozen=True, slots=True)
class OffloadEvent:
    """A change of what the host tier holds, for KV-event consumers.

    ``removed=False``: ``keys`` became loadable (a successful ``complete_store``).
    ``removed=True``: loadable ``keys`` left (evicted). A failed store makes no
    event: its keys were never announced, so a consumer has nothing to forget.
    """

    keys: list[bytes]
    removed: bool


class OffloadingManager(SlotStates):
    """Tracks offloaded blocks in a fixed number of equal host slots.

    :param slots: the slot count, or the :class:`~kvhal.offload.host_tier.SlotPool`
        to allocate from (a :class:`~kvhal.offload.host_tier.HostTier`'s ``pool``
        in a single process, so that the tier and the manager share one free list).
    :param policy: an eviction policy name (``"lru"``, ``"s3fifo"``, or one a
        plugin offers through ``kvhal_eviction_policies``) or a policy object.
    :param registry: where named policies are looked up (default: the
        installed plugins).
    :param enable_events: record :class:`OffloadEvent` for :meth:`take_events`.
    """

    _max_loads = sys.maxsize
    _add_refs = _native_add_refs  # a builtin: not bound as a method

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
        self._refs = self._ref_at = [0] * num_slots  # a list: 8 bytes a slot, faster than array("i") here
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

    def __len__(self) -> int:
        """Blocks tracked: storing or ready."""
        return len(self._index)

    def slot(self, key: bytes) -> int | None:
        """The host slot holding ``key``, or ``None``."""
        try:
            return self._index.get(key)
        except TypeError:
            raise ValidationError("key", _not_bytes(key)) from None

    def lookup(self, keys: Iterable[bytes]) -> int:
        """See :meth:`SlotStates.lookup`; natively, one call to the index."""
        if NATIVE:
            keys = keys if isinstance(keys, list) else _as_list(keys)
            try:
                return self._index.prefix(keys, self._refs)  # type: ignore[attr-defined]
            except TypeError:  # a key not exactly bytes: the Python path names it
                pass
        return super().lookup(keys)

    # -- the key index (what SlotStates asks of a tier) -------------------------

    def _slots(self, keys: Iterable[bytes]) -> list[int | None]:
        """Each key's slot or None, in one call to the index."""
        _refuse_one_key(keys)
        try:
            return self._index.slots(keys)
        except TypeError as exc:  # a key not exactly bytes (the index refuses it), or keys not iterable
            if isinstance(keys, list | tuple):
                bad = next((key for key in keys if type(key) is not bytes), None)
                if bad is not None:
                    raise ValidationError("keys", _not_bytes(bad)) from None
            raise ValidationError("keys", f"must be an iterable of bytes keys: {exc}") from None

    def _new_keys(self, keys: list[bytes]) -> tuple[list[int | None], list[bytes], list[bytes]]:
        present = self._slots(keys)
        new = [key for key, slot in zip(keys, present, strict=True) if slot is None]
        if len(new) > 1:
            new = list(dict.fromkeys(new))  # exact bytes (the index refused others): no caller's __eq__
        return present, new, new

    def _allocate(self, n: int) -> list[int]:
        slots = self._pool.allocate(n)
        assert slots is not None  # room was made
        return slots

    def _index_add(self, entries: list[bytes], slots: list[int]) -> None:
        self._index.add(entries, slots)

    def _index_remove(self, slots: list[int]) -> list[bytes]:
        return self._index.remove(slots)  # type: ignore[return-value]

    def _release(self, slots: list[int]) -> None:
        self._pool._release(slots)

    def _are_taken(self, slots: list[int]) -> bool:
        return self._pool.are_taken(slots)

    def _plan(
        self, keys: list[bytes], slots: list[int], evicted: list[bytes] | None, victims: list[int]
    ) -> StorePlan:
        if evicted and self._events is not None:
            self._events.append(OffloadEvent(evicted, removed=True))
        return StorePlan(keys, slots, evicted, victims)  # type: ignore[arg-type]

    # -- events --------------------------------------------------------------

    def _stored(self, keys: list[bytes]) -> None:
        if self._events is not None and keys:
            self._events.append(OffloadEvent(list(keys), removed=False))

    def take_events(self) -> list[OffloadEvent]:
        """The events since the last call (empty unless ``enable_events``)."""
        if not self._events:
            return []
        events, self._events = self._events, []
        return events


def _not_bytes(key: object) -> str:
    """Keys are exact bytes: a subclass's __hash__ or __eq__ would run inside the index."""
    return f"keys are bytes; got {type(key).__name__} {key!r:.40} (a bytes subclass: pass bytes(key))"
