"""Eviction policies: which offloaded block leaves when the host tier is full.

A policy keeps its own compact bookkeeping over the manager's *slots*
(integers ``0 .. num_slots - 1``), never over keys, so that a tracked block
costs a few bytes in it. Policies come from the ``kvhal_eviction_policies``
hook (:mod:`kvhal.hookspecs`): the built-in ``lru`` (the default, the same
order as vLLM 0.32's LRU), ``s3fifo`` and ``clock`` (one byte a slot, for
tiers of many millions of blocks) are offered by :class:`BuiltinPolicies`,
which :class:`~kvhal.registry.PluginRegistry` registers; any plugin can add
more. :func:`create_policy` picks one by name.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvhal.errors import PolicyError
from kvhal.hookspecs import hookimpl
from kvhal.offload.eviction_policy import EvictionPolicy, PolicyFactory

if TYPE_CHECKING:
    from kvhal.registry import PluginRegistry

try:
    from kvhal.offload._keyindex import LRU as _NativeLRU
except ImportError:  # built without a C compiler: the Python lists
    _NativeLRU = None

__all__ = [
    "DEFAULT_POLICY",
    "HOOK",
    "BuiltinPolicies",
    "ClockPolicy",
    "EvictionPolicy",
    "LRUPolicy",
    "PolicyFactory",
    "S3FIFOPolicy",
    "available_policies",
    "create_policy",
]

HOOK = "kvhal_eviction_policies"
DEFAULT_POLICY = "lru"


class LRUPolicy(EvictionPolicy):
    """Least recently used first: a doubly linked list over slots.

    Natively (``_keyindex.LRU``: two int32 arrays, 8 bytes a slot, one C call a request's
    blocks) unless built without a C compiler, or for a subclass, which may reach into the
    links: then two Python lists, 16 bytes a slot, where slot ``num_slots`` is the sentinel
    (its successor the least recently used slot, its predecessor the most recent one).
    """

    def __init__(self, num_slots: int) -> None:
        super().__init__(num_slots)
        if _NativeLRU is not None and type(self) is LRUPolicy:
            self._lru = _NativeLRU(num_slots)
            # the native calls themselves, not a Python method around each
            self.insert, self.touch, self.remove = self._lru.insert, self._lru.touch, self._lru.remove  # type: ignore[method-assign]
            self.evict = self._native_evict  # type: ignore[method-assign]
            return
        self._nil = num_slots
        self._prev = [num_slots] * (num_slots + 1)
        self._next = [num_slots] * (num_slots + 1)

    def _native_evict(self, n: int, pinned: Sequence[int]) -> list[int]:
        victims = self._lru.evict(n, pinned)
        if len(victims) < n:  # nothing was taken
            raise PolicyError(f"lru: found {len(victims)} unpinned slots, {n} asked for")
        return victims

    def insert(self, slots: Sequence[int], keys: Sequence[bytes]) -> None:
        prev, nxt, nil = self._prev, self._next, self._nil
        last = prev[nil]
        for slot in slots:
            prev[slot] = last
            nxt[last] = slot
            last = slot
        nxt[last] = nil
        prev[nil] = last

    def touch(self, slots: Sequence[int]) -> None:
        prev, nxt, nil = self._prev, self._next, self._nil
        last = prev[nil]  # the tail, kept here: its own next link is set once, at the end
        for slot in reversed(slots):
            if slot == last:  # the most recent already
                continue
            before, after = prev[slot], nxt[slot]
            nxt[before] = after
            prev[after] = before
            prev[slot] = last
            nxt[last] = slot
            last = slot
        nxt[last] = nil
        prev[nil] = last

    def remove(self, slots: Sequence[int]) -> None:
        prev, nxt = self._prev, self._next
        for slot in slots:
            before, after = prev[slot], nxt[slot]
            nxt[before] = after
            prev[after] = before

    def evict(self, n: int, pinned: Sequence[int]) -> list[int]:
        prev, nxt, nil = self._prev, self._next, self._nil
        victims: list[int] = []
        slot = nxt[nil]
        while len(victims) < n:
            if slot == nil:
                raise PolicyError(f"lru: found {len(victims)} unpinned slots, {n} asked for")
            after = nxt[slot]
            if not pinned[slot]:
                before = prev[slot]
                nxt[before] = after
                prev[after] = before
                victims.append(slot)
            slot = after
        return victims


class S3FIFOPolicy(EvictionPolicy):
    """S3-FIFO (Yang et al., SOSP 2023): a small probationary FIFO, a main
    FIFO, and a ghost FIFO of recently evicted keys.

    New blocks enter the small queue (10% of the slots), or the main queue
    when their key is a ghost. A block leaving the small queue moves to main
    if it was used more than once -- the storing request's own touch is the
    first use -- else it is evicted and its key's hash becomes a ghost. Main
    is a CLOCK-like FIFO with a 2-bit frequency. Pinned blocks are passed
    over as if used. Ghosts are key hashes (a collision only misjudges
    admission), at most as many as main's share of the slots.
    """

    SMALL_SHARE = 0.1

    def __init__(self, num_slots: int) -> None:
        super().__init__(num_slots)
        self._small: deque[int] = deque()
        self._main: deque[int] = deque()
        self._queue = bytearray(num_slots)  # 0: none, 1: small, 2: main
        self._freq = bytearray(num_slots)
        self._key: list[bytes | None] = [None] * num_slots
        self._small_target = max(1, int(num_slots * self.SMALL_SHARE))
        self._ghost: OrderedDict[int, None] = OrderedDict()
        self._ghost_limit = max(1, num_slots - self._small_target)

    def insert(self, slots: Sequence[int], keys: Sequence[bytes]) -> None:
        ghost = self._ghost
        for slot, key in zip(slots, keys, strict=True):
            self._key[slot] = key
            self._freq[slot] = 0
            h = hash(key)
            if h in ghost:
                del ghost[h]
                self._main.append(slot)
                self._queue[slot] = 2
            else:
                self._small.append(slot)
                self._queue[slot] = 1

    def touch(self, slots: Sequence[int]) -> None:
        freq = self._freq
        for slot in slots:
            if freq[slot] < 3:
                freq[slot] += 1

    def remove(self, slots: Sequence[int]) -> None:
        # O(queue length) each, but only failed stores come here.
        for slot in slots:
            (self._small if self._queue[slot] == 1 else self._main).remove(slot)
            self._queue[slot] = 0
            self._key[slot] = None

    def evict(self, n: int, pinned: Sequence[int]) -> list[int]:
        victims = []
        for _ in range(n):
            from_small = len(self._small) >= self._small_target or not self._main
            victim = self._evict_small(pinned) if from_small else self._evict_main(pinned)
            if victim is None:  # the other queue holds the unpinned blocks
                victim = self._evict_main(pinned) if from_small else self._evict_small(pinned)
            if victim is None:
                raise PolicyError(f"s3fifo: found {len(victims)} unpinned slots, {n} asked for")
            victims.append(victim)
        return victims

    def _forget(self, slot: int) -> int:
        self._queue[slot] = 0
        self._key[slot] = None
        return slot

    def _evict_small(self, pinned: Sequence[int]) -> int | None:
        small, freq = self._small, self._freq
        while small:
            slot = small.popleft()
            if freq[slot] > 1 or pinned[slot]:
                self._main.append(slot)
                self._queue[slot] = 2
                continue
            self._ghost[hash(self._key[slot])] = None
            if len(self._ghost) > self._ghost_limit:
                self._ghost.popitem(last=False)
            return self._forget(slot)
        return None

    def _evict_main(self, pinned: Sequence[int]) -> int | None:
        main, freq = self._main, self._freq
        # Four passes bring every unpinned frequency to zero.
        for _ in range(4 * len(main) + 1):
            if not main:
                return None
            slot = main.popleft()
            if freq[slot] or pinned[slot]:
                if freq[slot]:
                    freq[slot] -= 1
                main.append(slot)
                continue
            return self._forget(slot)
        return None


class ClockPolicy(EvictionPolicy):
    """CLOCK (second chance): one byte a slot and a hand, for tiers of many millions of blocks.

    A slot's byte is 0 (not inserted), 1 (inserted) or 2 (inserted and used
    since the hand last passed). The hand sweeps the slots in order: a used
    slot loses its mark and is passed over, an unused one is evicted. It
    approximates LRU without an order between the keys of one call. Sweeps
    work on windows of slots in numpy, so a bulk :meth:`insert` or a long
    sweep costs no Python loop per slot.
    """

    _FIRST_WINDOW = 256
    _MAX_WINDOW = 1 << 16

    def __init__(self, num_slots: int) -> None:
        super().__init__(num_slots)
        self._marks = np.zeros(num_slots, dtype=np.uint8)
        self._hand = 0

    def insert(self, slots: Sequence[int], keys: Sequence[bytes]) -> None:
        self._marks[np.asarray(slots, dtype=np.intp)] = 1

    def touch(self, slots: Sequence[int]) -> None:
        if len(slots) == 1:  # a scalar write is ~10x cheaper than fancy indexing
            if self._marks[slots[0]]:
                self._marks[slots[0]] = 2
            return
        slots = np.asarray(slots, dtype=np.intp)
        marks = self._marks
        marks[slots[marks[slots] != 0]] = 2

    def remove(self, slots: Sequence[int]) -> None:
        self._marks[np.asarray(slots, dtype=np.intp)] = 0

    def evict(self, n: int, pinned: Sequence[int]) -> list[int]:
        marks, size = self._marks, self.num_slots
        victims: list[np.ndarray] = []
        found, swept, window = 0, 0, self._FIRST_WINDOW
        # Two turns: the first clears every unpinned mark, the second finds its victims.
        while found < n and swept < 2 * size + window:
            start = self._hand
            stop = min(start + window, size)
            marks_here = marks[start:stop]
            free_here = np.asarray(pinned[start:stop]) == 0
            candidates = np.flatnonzero((marks_here == 1) & free_here)
            if len(candidates) >= n - found:
                last = candidates[n - found - 1]  # the hand stops past the last victim
                chosen = candidates[: n - found]
                stop = start + last + 1
                marks_here = marks_here[: last + 1]
                free_here = free_here[: last + 1]
            else:
                chosen = candidates
            # Second chance: passed-over used slots lose their mark; pinned ones keep it.
            marks_here[(marks_here == 2) & free_here] = 1
            marks_here[chosen] = 0
            victims.append(chosen + start)
            found += len(chosen)
            swept += stop - start
            self._hand = 0 if stop == size else stop
            window = min(window * 2, self._MAX_WINDOW)
        if found < n:
            raise PolicyError(f"clock: found {found} unpinned slots, {n} asked for")
        return np.concatenate(victims).tolist()


class BuiltinPolicies:
    """The built-in plugin offering ``lru``, ``s3fifo`` and ``clock`` through the policy hook."""

    @hookimpl
    def kvhal_eviction_policies(self) -> Mapping[str, PolicyFactory]:
        return {"lru": LRUPolicy, "s3fifo": S3FIFOPolicy, "clock": ClockPolicy}


def available_policies(registry: PluginRegistry) -> dict[str, PolicyFactory]:
    """Every policy the registry's plugins offer, by name.

    :raises MalformedResultError: a plugin answered with something other than
        a mapping of names to factories.
    :raises PluginError: two plugins offer the same name.
    """
    return {name: offer.factory for name, offer in registry.named_factories(HOOK, "policy").items()}


def create_policy(name: str, num_slots: int, registry: PluginRegistry) -> EvictionPolicy:
    """A fresh policy ``name`` for ``num_slots`` slots, from ``registry``'s plugins.

    :raises ValidationError: no plugin offers ``name`` (the message lists those known).
    :raises MalformedResultError: its factory returned something else than an
        :class:`EvictionPolicy` (names the plugin).
    :raises PluginError: the hook or the factory raised (names the plugin).
    """
    return registry.create_named(
        HOOK,
        name,
        (num_slots,),
        expected=EvictionPolicy,
        what="policy",
        argument="policy",
        label="eviction policy",
    )
