"""The eviction-policy contract: what an offloading manager asks of a policy.

It sits at the contract level beside :mod:`kvhal.hookspecs` (whose
``kvhal_eviction_policies`` hook offers policies by name) and depends on
nothing else in kvhal. Implementations live in :mod:`kvhal.offload.eviction` and in
plugins.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence


class EvictionPolicy(abc.ABC):
    """Recency/frequency bookkeeping over a manager's slots, and the choice of victims.

    The manager calls, with slot ids it owns:

    - :meth:`insert` when blocks enter (at ``prepare_store``, before their
      bytes are written; they stay pinned until the store completes);
    - :meth:`touch` when blocks are used;
    - :meth:`remove` when blocks leave other than by :meth:`evict` (a failed store);
    - :meth:`evict` to free room.

    :param num_slots: the manager's slot count; every slot id is below it.
    """

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots

    @abc.abstractmethod
    def insert(self, slots: Sequence[int], keys: Sequence[bytes]) -> None:
        """``slots`` now hold ``keys`` (in order: the last one entered last)."""

    @abc.abstractmethod
    def touch(self, slots: Sequence[int]) -> None:
        """``slots`` were used, the *first* one most recently: a prefix's head
        serves every request that its tail serves, so it should outlive it
        (vLLM's LRU orders a request's blocks the same way)."""

    @abc.abstractmethod
    def remove(self, slots: Sequence[int]) -> None:
        """Forget ``slots`` (their store failed)."""

    @abc.abstractmethod
    def evict(self, n: int, pinned: Sequence[int]) -> list[int]:
        """Choose and forget exactly ``n`` distinct slots none of which is pinned.

        ``pinned[slot] != 0`` marks a slot that must stay: its store or a load
        is in flight, or the caller protects it. The manager calls this only
        when at least ``n`` unpinned slots are inserted.
        """


#: ``factory(num_slots)`` returns a fresh policy for a manager of ``num_slots`` slots.
PolicyFactory = Callable[[int], EvictionPolicy]
