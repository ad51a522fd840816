"""The tier chain: the host tier's manager over an ordered list of tiers below it.

Bytes flow device <-> host slots <-> a tier below. The host tier stays the
staging area: a device never reads or writes a tier below, so one disk,
object-store or network backend serves every device plugin. This module
decides, where the engine schedules, which blocks move; it never touches
bytes (the workers do, through :mod:`kvhal.tiers.io` and the stores).

Every tier below the host tier is a :class:`ChainTier` of one list, in the
order the user configured it (say a disk, then Redis, then an object store):

- a **local** tier (the disk tier, a plugin's backend through
  ``kvhal_tier_backends``) has equal slots whose index
  (:class:`~kvhal.tiers.index.TierIndex`) the chain keeps: what it holds is
  known here, at once;
- a **shared** tier (a store the fleet shares, ``kvhal_remote_stores``) names
  its values by key; what it holds is learnt by asking it (the adapter does,
  and hands the answer in as ``held``).

- **Lookups** find the host tier's ready prefix of a request's keys, then how
  far the tiers below continue it: a key counts where the first tier of the
  list that holds it can be read into a fresh host slot (:meth:`TierChain.lookup`).
- **Loads** of a hit found below are *promoted*: fresh host slots are taken
  for them (evicting as any store does), the worker reads each block from the
  first tier holding it (:class:`TierRead`, one per tier), and then loads them
  into the device as any host hit (:meth:`TierChain.prepare_load`). Nothing
  here waits.
- **Stores** cascade to every tier the adapter names. A local tier with
  ``write="through"`` (the default) and every shared tier get a write planned
  with the host store (:class:`WritePlan`); the worker chains it to the store's
  copy, and the host slot stays pinned until the write ends. A local tier with
  ``write="back"`` is written only when the host tier evicts a block, from a
  snapshot taken before its slot is reused (:meth:`TierChain.take_writes`).

Write-through is the default because a tier below is what survives a restart
or a crash: under write-back, everything that lived only in host memory is
lost with the process, and writes come in bursts exactly when the host tier is
under pressure. Write-back writes less, which suits a tier with costly writes.

A local tier whose medium is not this engine's yet (another engine still holds it, in a
rolling update) is in the list but not :attr:`ChainTier.ready`: nothing is read from it or
written to it, and its index stays empty, until the adapter recovers that index and sets it
ready (:class:`~kvhal.tiers.backend.TierBackend`'s ``ready``).

A failed read forgets the blocks it was promoting from a local tier (the engine
recomputes them, and a later store writes them again); a failed write leaves
nothing loadable.

With ``events=True`` the chain tells what each tier below came to hold and lost
(:meth:`TierChain.take_tier_events`, as the host tier's manager does with
``enable_events``): a write that ended well stored its blocks, an eviction from a local
tier or a failed read's forgetting removed them. A store never says what it evicts, so a
store's blocks are only ever stored. The index keeps hashes, not keys: to name what a
local tier evicts, the chain then keeps each of its slots' keys (a dict entry a block).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from kvhal.errors import BlockStateError, ValidationError
from kvhal.offload.manager import BlockState, OffloadingManager, StorePlan
from kvhal.tiers.index import TierIndex

WriteMode = Literal["through", "back"]
WRITE_MODES: tuple[str, ...] = ("through", "back")
#: What the adapter learnt of the shared tiers: tier name -> keys it holds.
Held = Mapping[str, Collection[bytes]]


@dataclass
class ChainTier:
    """One tier below the host tier, as the chain sees it.

    :param name: its name, unique in the chain (the ``tier`` label of its counters).
    :param index: a local tier's slot index; ``None`` for a shared tier (a store
        names its values by key: no slots, and what it holds is asked of it).
    :param write: a local tier's write mode (``"through"`` or ``"back"``); a shared
        tier is written through.
    :param ready: whether the tier serves: False while its medium is not this engine's yet
        (it is then never read or written, whatever its index says).
    """

    name: str
    index: TierIndex | None = None
    write: WriteMode = "through"
    ready: bool = True
    #: blocks not written since the adapter last looked: no evictable room
    skipped_writes: int = 0
    #: blocks evicted from the tier since the adapter last looked
    evictions: int = 0

    def __post_init__(self) -> None:
        if self.write not in WRITE_MODES:
            raise ValidationError("write", f"must be one of {list(WRITE_MODES)}, got {self.write!r}")
        if self.index is None and self.write != "through":
            raise ValidationError("write", f"tier {self.name!r}: a shared tier is written through")

    @property
    def shared(self) -> bool:
        return self.index is None

    def holds(self, key: bytes, held: Held) -> bool:
        """Whether a read of ``key`` from this tier can be planned now."""
        if not self.ready:
            return False
        if self.index is not None:
            return self.index.state(key) is BlockState.READY
        return key in held.get(self.name, ())


@dataclass(frozen=True, slots=True)
class TierRead:
    """Blocks a load reads from one tier below into fresh host slots first.

    :param tier: the tier's name.
    :param slots: a local tier's slots of ``keys``; empty for a shared tier.
    :param positions: each key's block in its request, where the planner gave them (a
        store reads runs of blocks stored as one value by them); empty: not known.
    """

    tier: str
    keys: list[bytes]
    slots: list[int]
    host_slots: list[int]
    positions: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """What :meth:`TierChain.prepare_load` decided for one load.

    :param keys: every key loaded, in the order given.
    :param host_slots: the host slot of each of ``keys``.
    :param reads: the keys read from a tier below first, one :class:`TierRead` per
        tier, in the chain's order.
    """

    keys: list[bytes]
    host_slots: list[int]
    reads: list[TierRead] = field(default_factory=list)

    @property
    def read_keys(self) -> list[bytes]:
        return [key for read in self.reads for key in read.keys]

    @property
    def host_hits(self) -> list[bytes]:
        below = set(self.read_keys)
        return [key for key in self.keys if key not in below]


@dataclass(slots=True)
class WritePlan:
    """Blocks to copy from host slots into one tier below.

    :param slots: a local tier's slots; empty for a shared tier.
    :param snapshot: the host slots are being reused (write-back of evicted
        blocks): the worker copies them out before the step's copies run.
        Otherwise (write-through) the write follows the host store of the same
        blocks, whose slots stay pinned from that store's completion until
        :meth:`TierChain.complete_write`.
    """

    tier: str
    keys: list[bytes]
    host_slots: list[int]
    slots: list[int]
    snapshot: bool = False
    pinned: bool = False  # the chain pinned the host slots for it
    positions: list[int] = field(default_factory=list)  # each key's block in its request, if known


@dataclass(frozen=True, slots=True)
class TierEvent:
    """Blocks that became ready in a tier below (``removed``: left it)."""

    tier: str
    keys: list[bytes]
    removed: bool = False


class TierChain:
    """A host tier's :class:`~kvhal.offload.manager.OffloadingManager` over an ordered list
    of :class:`ChainTier` (none: the host tier alone)."""

    def __init__(
        self, host: OffloadingManager, tiers: Sequence[ChainTier] = (), events: bool = False
    ) -> None:
        names = [tier.name for tier in tiers]
        if len(set(names)) != len(names):
            raise ValidationError("tiers", f"tier names must be unique, got {names}")
        self.host = host
        self.tiers = list(tiers)
        self._by_name = {tier.name: tier for tier in self.tiers}
        self._writes: list[WritePlan] = []
        self.events = events
        self._events: list[TierEvent] = []
        self._keys_at: dict[str, dict[int, bytes]] = {tier.name: {} for tier in self.local}  # slot -> key

    def tier(self, name: str) -> ChainTier:
        return self._by_name[name]

    @property
    def local(self) -> list[ChainTier]:
        """The tiers whose index the chain keeps, in order."""
        return [tier for tier in self.tiers if tier.index is not None]

    def holder(self, key: bytes, held: Held = {}) -> ChainTier | None:  # noqa: B006 - read only
        """The first tier of the list that can serve ``key`` (``None``: none)."""
        for tier in self.tiers:
            if tier.holds(key, held):
                return tier
        return None

    # -- lookups and loads -------------------------------------------------------

    def lookup(self, keys: Sequence[bytes], held: Held = {}) -> tuple[int, int]:  # noqa: B006
        """``(hits, below)``: how many of ``keys``, from the first, can be loaded, and how
        many of those only a tier below holds (they would be promoted).

        A key counts while it is ready in the host tier, or absent from it and held by a
        tier below (a shared tier: in ``held``) with room in the host tier to promote it.
        """
        keys = list(keys)
        hits = self.host.lookup(keys)
        if not self.tiers or hits == len(keys):
            return hits, 0
        # A promotion takes host slots that only evictable blocks can give, and the load
        # pins its host hits first: the idle hits and the promotions must fit together.
        capacity = self.host.num_free + self.host.num_evictable
        idle = sum(1 for key in keys[:hits] if not self.host.loads_in_flight(key))
        below = 0
        for key in keys[hits:]:
            state = self.host.state(key)
            if state is BlockState.READY:
                cost = 0 if self.host.loads_in_flight(key) else 1
                if below and below + idle + cost > capacity:
                    break
                idle += cost
            elif state is BlockState.ABSENT and self.holder(key, held) is not None:
                if below + 1 + idle > capacity:
                    break
                below += 1
            else:
                break
            hits += 1
        return hits, below

    def prepare_load(
        self,
        keys: Sequence[bytes],
        held: Held = {},  # noqa: B006
        positions: Sequence[int] | None = None,
    ) -> LoadPlan | None:
        """Protect ``keys`` until :meth:`complete_load`: host-ready ones as loads, the
        others as reads into fresh host slots, each from the first tier holding it
        (``positions``, each key's block in its request, go with the reads).

        :return: the plan, or ``None`` (nothing changed) if the host tier cannot
            take the blocks read from below -- every other block is being stored or loaded.
        :raises BlockStateError: a key is ready in no tier (nothing changed).
        """
        keys = list(keys)
        try:  # every key ready in the host tier (the usual hit): one call
            return LoadPlan(keys, self.host.prepare_load(keys))
        except BlockStateError:  # some are not (nothing changed): read from the tiers below
            pass
        states = [self.host.state(key) for key in keys]
        hits = [key for key, state in zip(keys, states, strict=True) if state is BlockState.READY]
        below = [key for key, state in zip(keys, states, strict=True) if state is not BlockState.READY]
        by_tier: dict[str, list[bytes]] = {}
        if below:
            for key, state in zip(keys, states, strict=True):
                if state is BlockState.STORING:
                    raise BlockStateError("keys", f"{key!r:.60} is still being stored to the host tier")
            if len(set(below)) < len(below):
                raise BlockStateError("keys", "a key read from a tier below is listed twice")
            for key in below:
                tier = self.holder(key, held)
                if tier is None:
                    raise BlockStateError("keys", f"{key!r:.60} is ready in no tier")
                by_tier.setdefault(tier.name, []).append(key)
        hit_slots = self.host.prepare_load(hits)
        tier_slots: dict[str, list[int]] = {}
        store: StorePlan = StorePlan([], [], [])
        if below:
            for name, tier_keys in by_tier.items():
                index = self._by_name[name].index
                tier_slots[name] = index.prepare_load(tier_keys) if index is not None else []
            promoted = [key for tier in self.tiers for key in by_tier.get(tier.name, ())]
            planned = self.host.prepare_store(promoted)
            if planned is None:
                self._end_tier_loads(by_tier, success=True)
                self.host.complete_load(hits)
                return None
            store = planned
            self._after_host_store(store)
        where = dict(zip(hits, hit_slots, strict=True))
        where.update(zip(store.keys, store.slots, strict=True))
        at = dict(zip(keys, positions, strict=True)) if positions is not None else {}
        reads = [
            TierRead(
                tier.name,
                by_tier[tier.name],
                tier_slots[tier.name],
                [where[k] for k in by_tier[tier.name]],
                [at[k] for k in by_tier[tier.name]] if at else [],
            )
            for tier in self.tiers
            if tier.name in by_tier
        ]
        return LoadPlan(keys, [where[key] for key in keys], reads)

    def complete_load(self, plan: LoadPlan, success: bool = True, failed: Collection[bytes] = ()) -> None:
        """End ``plan``'s load. Promoted blocks become host-ready on success; on failure
        they leave the host tier, and the local tier they came from (a read that failed
        may have found them corrupt). ``failed``: on success, the promoted blocks whose
        reads failed all the same, which leave alone (the others stay loadable)."""
        self.host.complete_load(plan.host_hits)
        lost = set(failed)
        for read in plan.reads:
            if success and lost:
                self.host.complete_store([key for key in read.keys if key not in lost])
                self.host.complete_store([key for key in read.keys if key in lost], success=False)
            else:
                self.host.complete_store(read.keys, success=success)
        self._end_tier_loads({read.tier: read.keys for read in plan.reads}, success, lost)

    def _end_tier_loads(
        self, by_tier: Mapping[str, list[bytes]], success: bool, lost: Collection[bytes] = ()
    ) -> None:
        for name, keys in by_tier.items():
            index = self._by_name[name].index
            if index is not None:
                index.complete_load(keys)
                gone = keys if not success else [key for key in keys if key in lost]
                if gone:
                    slots = [index.slot(key) for key in gone]
                    index.forget(gone)
                    self._removed(name, slots)

    # -- stores --------------------------------------------------------------------

    def prepare_store(
        self, keys: Sequence[bytes], tiers: Iterable[str] = ()
    ) -> tuple[StorePlan, list[WritePlan]] | None:
        """:meth:`OffloadingManager.prepare_store` on the host tier, and the writes of the
        stored blocks to the tiers named in ``tiers`` that are written through (to run
        once the store's copy is done). The blocks the store evicts are queued for the
        named tiers written back (:meth:`take_writes`). A tier not named, or not ready, is not written
        (the adapter leaves out a tier not worth reading, or a store that is down).

        :return: the host plan and its writes, or ``None`` if the host tier has no room.
        """
        plan = self.host.prepare_store(keys)
        if plan is None:
            return None
        named = set(tiers)
        self._after_host_store(plan, named)
        writes = []
        if plan.keys:
            where = dict(zip(plan.keys, plan.slots, strict=True))
            for tier in self.tiers:
                if tier.name not in named or tier.write != "through" or not tier.ready:
                    continue
                planned = self._plan_write(tier, plan.keys)
                if planned is not None:
                    tier_keys, slots = planned
                    writes.append(WritePlan(tier.name, tier_keys, [where[k] for k in tier_keys], slots))
        return plan, writes

    def _after_host_store(self, plan: StorePlan, named: Collection[str] | None = None) -> None:
        """Queue the write-back snapshots of the blocks ``plan`` evicted (every tier
        written back, or those in ``named``)."""
        if not plan.evicted:
            return
        by_key = dict(zip(plan.evicted, plan.evicted_slots, strict=True))
        for tier in self.tiers:
            if tier.write != "back" or not tier.ready or (named is not None and tier.name not in named):
                continue
            planned = self._plan_write(tier, plan.evicted)
            if planned is not None:
                tier_keys, slots = planned
                host_slots = [by_key[k] for k in tier_keys]
                self._writes.append(WritePlan(tier.name, tier_keys, host_slots, slots, snapshot=True))

    def _plan_write(self, tier: ChainTier, keys: list[bytes]) -> tuple[list[bytes], list[int]] | None:
        if tier.index is None:  # a store: every key, named by itself
            return (list(keys), []) if keys else None
        plan = tier.index.prepare_store(keys)
        if plan is None:
            tier.skipped_writes += len(keys)
            return None
        tier.evictions += len(plan.evicted)
        if self.events:
            self._removed(tier.name, plan.evicted)  # type: ignore[arg-type] - a TierIndex's are slots
            self._keys_at[tier.name].update(zip(plan.slots, plan.keys, strict=True))
        return (plan.keys, plan.slots) if plan.keys else None

    def complete_store(
        self, keys: Sequence[bytes], success: bool = True, writes: Iterable[WritePlan] = ()
    ) -> None:
        """:meth:`OffloadingManager.complete_store`; the host slots of ``writes`` (the
        store's own write-throughs) stay pinned until :meth:`complete_write`."""
        self.host.complete_store(keys, success=success)
        for plan in writes:
            if success and plan.keys:
                self.host.prepare_load(plan.keys)
                plan.pinned = True

    def has_planned_writes(self) -> bool:
        """Whether writes are planned that :meth:`take_writes` has not handed out yet."""
        return bool(self._writes)

    def take_writes(self) -> list[WritePlan]:
        """The write-back snapshots planned since the last call."""
        writes, self._writes = self._writes, []
        return writes

    def complete_write(self, plan: WritePlan, success: bool = True) -> None:
        """End ``plan``'s write: its blocks are ready in its tier (or forgotten), and the
        host slots a write-through pinned are released. A write-through whose store
        failed ends here too, as failed: the worker never ran it."""
        index = self._by_name[plan.tier].index
        ok = success and (plan.snapshot or plan.pinned)  # else the worker never wrote it
        if index is not None:
            index.complete_store(plan.keys, success=ok)
        if self.events and plan.keys:
            if ok:
                self._events.append(TierEvent(plan.tier, list(plan.keys)))
            elif index is not None:  # never announced: the slots are free again
                for slot in plan.slots:
                    self._keys_at[plan.tier].pop(slot, None)
        if plan.pinned:
            self.host.complete_load(plan.keys)
            plan.pinned = False

    # -- events --------------------------------------------------------------------

    def _removed(self, tier: str, slots: Iterable[int | None]) -> None:
        """The blocks of ``slots`` left local ``tier`` (the keys its writes announced)."""
        if not self.events:
            return
        keys_at = self._keys_at[tier]
        keys = [key for slot in slots if slot is not None and (key := keys_at.pop(slot, None)) is not None]
        if keys:
            self._events.append(TierEvent(tier, keys, removed=True))

    def take_tier_events(self) -> list[TierEvent]:
        """What the tiers below stored and removed since the last call, in order."""
        events, self._events = self._events, []
        return events
