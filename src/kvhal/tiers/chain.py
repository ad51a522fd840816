"""The tier chain: the host tier's manager and the index of the tier below it.

Bytes flow device <-> host slots <-> lower tier. The host tier stays the
staging area: a device never reads or writes a lower tier, so one disk or
network backend serves every device plugin. This module decides, where the
engine schedules, which blocks move; it never touches bytes (the workers do,
through :mod:`kvhal.tiers.io`).

- **Lookups** find the host tier's ready prefix of a request's keys, then
  how far the lower tier continues it (:meth:`TierChain.lookup`).
- **Loads** of a hit found only below are *promoted*: fresh host slots are
  taken for them (evicting as any store does), the worker reads the blocks
  into those slots, and then loads them into the device as any host hit
  (:meth:`TierChain.prepare_load`). Nothing here waits: the request is parked
  by the engine while its load is in flight, as for a host hit.
- **Stores** cascade. ``write="through"`` (the default) plans each block's
  lower-tier write with its host store; the worker chains the write to the
  store's copy (no round trip through the scheduler, so a shutdown can flush
  it), and the host slot stays pinned until the write ends. ``write="back"``
  writes a block only when the host tier evicts it, from a snapshot taken
  before its slot is reused.

Write-through is the default because the lower tier is what survives a
restart or a crash: under write-back, everything that lived only in host
memory is lost with the process, and writes come in bursts exactly when the
host tier is under pressure. Write-back writes less (blocks that die in host
memory are never written), which suits a lower tier with costly writes.

A failed read forgets the blocks it was promoting from the lower tier (the
engine recomputes them, and a later store writes them again); a failed write
leaves nothing loadable.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Literal

from kvhal.errors import BlockStateError, ValidationError
from kvhal.offload.manager import BlockState, OffloadingManager, StorePlan
from kvhal.tiers.index import TierIndex

WriteMode = Literal["through", "back"]
WRITE_MODES: tuple[str, ...] = ("through", "back")


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """What :meth:`TierChain.prepare_load` decided for one load.

    :param keys: every key loaded, in the order given.
    :param host_slots: the host slot of each of ``keys``.
    :param promoted: the keys read from the lower tier first (a sub-list of ``keys``).
    :param lower_slots: their lower-tier slots.
    :param promoted_host_slots: the host slots they are read into.
    :param fetched: the keys read from the remote tier first (neither the host
        tier nor the lower tier holds them).
    :param fetched_host_slots: the host slots they are read into.
    """

    keys: list[bytes]
    host_slots: list[int]
    promoted: list[bytes]
    lower_slots: list[int]
    promoted_host_slots: list[int]
    fetched: list[bytes] = field(default_factory=list)
    fetched_host_slots: list[int] = field(default_factory=list)

    @property
    def host_hits(self) -> list[bytes]:
        below = set(self.promoted) | set(self.fetched)
        return [key for key in self.keys if key not in below]


@dataclass(slots=True)
class WritePlan:
    """Blocks to copy from host slots into lower-tier slots.

    :param snapshot: the host slots are being reused (write-back of evicted
        blocks): the worker copies them out before the step's copies run.
        Otherwise (write-through) the write follows the host store of the same
        blocks, whose slots stay pinned from that store's completion until
        :meth:`TierChain.complete_write`.
    """

    keys: list[bytes]
    host_slots: list[int]
    lower_slots: list[int]
    snapshot: bool
    pinned: bool = False  # the chain pinned the host slots for it
    remote: bool = False  # a write to the remote tier (no lower-tier slots)


class TierChain:
    """A host tier's :class:`~kvhal.offload.manager.OffloadingManager` and, optionally,
    the :class:`~kvhal.tiers.index.TierIndex` of one tier below it.

    :param host: the host tier's manager.
    :param lower: the lower tier's index, or ``None`` (the host tier alone).
    :param write: ``"through"`` or ``"back"`` (see the module docstring).
    """

    def __init__(
        self, host: OffloadingManager, lower: TierIndex | None = None, write: WriteMode = "through"
    ) -> None:
        if write not in WRITE_MODES:
            raise ValidationError("write", f"must be one of {list(WRITE_MODES)}, got {write!r}")
        self.host = host
        self.lower = lower
        self.write: WriteMode = write
        self._writes: list[WritePlan] = []
        self.skipped_writes = 0  # blocks not written: the lower tier had no evictable room
        self.lower_evictions = 0

    # -- lookups and loads -------------------------------------------------------

    def lookup(self, keys: Sequence[bytes]) -> tuple[int, int]:
        """``(hits, promoted)``: how many of ``keys``, from the first, can be loaded,
        and how many of those only the lower tier holds (they would be promoted).

        A key counts while it is ready in the host tier, or absent from it and
        ready below with room in the host tier to promote it.
        """
        keys = list(keys)
        hits = self.host.lookup(keys)
        if self.lower is None or hits == len(keys):
            return hits, 0
        # A promotion takes host slots that only evictable blocks can give, and the load
        # pins its host hits first: the idle hits and the promotions must fit together.
        capacity = self.host.num_free + self.host.num_evictable
        idle = sum(1 for key in keys[:hits] if not self.host.loads_in_flight(key))
        promoted = 0
        for key in keys[hits:]:
            state = self.host.state(key)
            if state is BlockState.READY:
                cost = 0 if self.host.loads_in_flight(key) else 1
                if promoted and promoted + idle + cost > capacity:
                    break
                idle += cost
            elif state is BlockState.ABSENT and self.lower.state(key) is BlockState.READY:
                if promoted + 1 + idle > capacity:
                    break
                promoted += 1
            else:
                break
            hits += 1
        return hits, promoted

    def room(self, keys: Sequence[bytes]) -> int:
        """How many more blocks the host tier could take by promotion, after a load of
        ``keys`` (a hit :meth:`lookup` found): what a remote tier may add to the hit."""
        capacity = self.host.num_free + self.host.num_evictable
        for key in keys:
            if self.host.state(key) is not BlockState.READY:
                capacity -= 1  # promoted into a fresh slot
            elif not self.host.loads_in_flight(key):
                capacity -= 1  # pinned by the load: evictable no more
        return max(capacity, 0)

    def prepare_load(self, keys: Sequence[bytes], fetch: Collection[bytes] = ()) -> LoadPlan | None:
        """Protect ``keys`` until :meth:`complete_load`: host-ready ones as loads, the
        others as reads into fresh host slots: from the lower tier where it holds
        them (promotions), else from the remote tier if listed in ``fetch``.

        :return: the plan, or ``None`` (nothing changed) if the host tier cannot
            take the blocks read from below -- every other block is being stored or loaded.
        :raises BlockStateError: a key is ready in no tier (nothing changed).
        """
        keys = list(keys)
        states = [self.host.state(key) for key in keys]
        hits = [key for key, state in zip(keys, states, strict=True) if state is BlockState.READY]
        below = [key for key, state in zip(keys, states, strict=True) if state is not BlockState.READY]
        promoted: list[bytes] = []
        fetched: list[bytes] = []
        if below:
            for key, state in zip(keys, states, strict=True):
                if state is BlockState.STORING:
                    raise BlockStateError("keys", f"{key!r:.60} is still being stored to the host tier")
            if len(set(below)) < len(below):
                raise BlockStateError("keys", "a key read from a tier below is listed twice")
            for key in below:
                if self.lower is not None and self.lower.state(key) is BlockState.READY:
                    promoted.append(key)
                elif key in fetch:
                    fetched.append(key)
                elif self.lower is None:
                    raise BlockStateError("keys", f"{key!r:.60} is not ready in the host tier, nor fetched")
                else:
                    raise BlockStateError("keys", f"{key!r:.60} is ready in neither tier, nor fetched")
        hit_slots = self.host.prepare_load(hits)
        lower_slots: list[int] = []
        store: StorePlan | None = StorePlan([], [], [])
        if below:
            if promoted:
                assert self.lower is not None
                lower_slots = self.lower.prepare_load(promoted)
            store = self.host.prepare_store(promoted + fetched)
            if store is None:
                if promoted:
                    assert self.lower is not None
                    self.lower.complete_load(promoted)
                self.host.complete_load(hits)
                return None
            self._after_host_store(store)
        where = dict(zip(hits, hit_slots, strict=True))
        where.update(zip(store.keys, store.slots, strict=True))
        return LoadPlan(
            keys,
            [where[key] for key in keys],
            promoted,
            lower_slots,
            [where[key] for key in promoted],
            fetched,
            [where[key] for key in fetched],
        )

    def complete_load(self, plan: LoadPlan, success: bool = True) -> None:
        """End ``plan``'s load. Promoted blocks become host-ready on success; on
        failure they leave the host tier and the lower tier both (a read that
        failed may have found them corrupt)."""
        self.host.complete_load(plan.host_hits)
        if plan.fetched:
            self.host.complete_store(plan.fetched, success=success)
        if plan.promoted:
            assert self.lower is not None
            self.host.complete_store(plan.promoted, success=success)
            self.lower.complete_load(plan.promoted)
            if not success:
                self.lower.forget(plan.promoted)

    # -- stores --------------------------------------------------------------------

    def prepare_store(
        self, keys: Sequence[bytes], below: bool = True
    ) -> tuple[StorePlan, WritePlan | None] | None:
        """:meth:`OffloadingManager.prepare_store` on the host tier, and under
        write-through the write of the stored blocks below (to run once the store's
        copy is done). Under write-back, the blocks the store evicts are queued for
        the lower tier instead (:meth:`take_writes`). ``below=False``: nothing is
        written below (a lower tier not worth reading is not worth writing).

        :return: the host plan and its write (``None`` if there is none), or
            ``None`` if the host tier has no room.
        """
        plan = self.host.prepare_store(keys)
        if plan is None:
            return None
        if below:
            self._after_host_store(plan)
        write = None
        if below and self.lower is not None and self.write == "through" and plan.keys:
            planned = self._plan_write(plan.keys)
            if planned is not None:
                keys, lower_slots = planned
                where = dict(zip(plan.keys, plan.slots, strict=True))
                write = WritePlan(keys, [where[k] for k in keys], lower_slots, snapshot=False)
        return plan, write

    def _after_host_store(self, plan: StorePlan) -> None:
        if self.lower is None or self.write != "back" or not plan.evicted:
            return
        by_key = dict(zip(plan.evicted, plan.evicted_slots, strict=True))
        write = self._plan_write(plan.evicted)
        if write is not None:
            keys, lower_slots = write
            self._writes.append(WritePlan(keys, [by_key[k] for k in keys], lower_slots, snapshot=True))

    def complete_store(
        self,
        keys: Sequence[bytes],
        success: bool = True,
        write: WritePlan | None = None,
        remote: WritePlan | None = None,
    ) -> None:
        """:meth:`OffloadingManager.complete_store`; the host slots of ``write`` and
        ``remote`` (the store's own write-through to the lower and the remote tier)
        stay pinned until :meth:`complete_write`."""
        self.host.complete_store(keys, success=success)
        for plan in (write, remote):
            if plan is not None and success and plan.keys:
                self.host.prepare_load(plan.keys)
                plan.pinned = True

    def remote_write(self, plan: StorePlan, keys: Collection[bytes] = ()) -> WritePlan | None:
        """The write of ``plan``'s stored blocks to the remote tier (limited to ``keys``
        if given), to run once the store's copy is done; ``None`` if there is none."""
        where = [(k, s) for k, s in zip(plan.keys, plan.slots, strict=True) if not keys or k in keys]
        if not where:
            return None
        return WritePlan([k for k, _ in where], [s for _, s in where], [], snapshot=False, remote=True)

    def _plan_write(self, keys: list[bytes]) -> tuple[list[bytes], list[int]] | None:
        assert self.lower is not None
        plan = self.lower.prepare_store(keys)
        if plan is None:
            self.skipped_writes += len(keys)
            return None
        self.lower_evictions += len(plan.evicted)
        return (plan.keys, plan.slots) if plan.keys else None

    def has_planned_writes(self) -> bool:
        """Whether writes are planned that :meth:`take_writes` has not handed out yet."""
        return bool(self._writes)

    def take_writes(self) -> list[WritePlan]:
        """The writes to the lower tier planned since the last call."""
        writes, self._writes = self._writes, []
        return writes

    def complete_write(self, plan: WritePlan, success: bool = True) -> None:
        """End ``plan``'s write: its blocks are ready below (or forgotten), and the
        host slots a write-through pinned are released. A write-through whose
        store failed ends here too, as failed: the worker never ran it."""
        if not plan.remote:
            assert self.lower is not None
            self.lower.complete_store(plan.keys, success=success and (plan.snapshot or plan.pinned))
        if plan.pinned:
            self.host.complete_load(plan.keys)
            plan.pinned = False
