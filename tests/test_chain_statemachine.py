"""The tier chain over a real host tier and a real disk tier, against a reference model
(hypothesis state machine).

The system: a :class:`HostTier` on the CPU device (6 slots) whose view is layer-major
(a slot is one run per layer) or cross-layer (one run), its
:class:`OffloadingManager`, a :class:`DiskTier` in a temporary directory (12 slots; an
``index`` role for recovery, an ``io`` role for bytes), its :class:`TierIndex`, the
:class:`TierChain` over it (one :class:`ChainTier`, ``disk``, written through or
back) and :class:`TierIO`. Steps call them in the order the vLLM connector does: the
scheduler side plans, the worker side copies bytes, the scheduler completes.

The disk's calls are deferred until a rule finishes them, so loads and writes stay
in flight across steps (what the chain pins must then stay untouched), and faults
are injected per call (EIO on payloads, on records after the payload -- a torn
write -- or on reads).

The model knows each key's bytes (random, fixed per key: a key names its content),
its state in each tier, the pins on it, and what every disk slot physically holds
(key and whether its payload is intact). Checked: a key is loadable only if the
model has it ready in some tier; every delivered block's bytes are the key's; a read
succeeds exactly when the slot holds the key intact; recovery finds exactly the
records on disk; nothing pinned is evicted, and pins are released.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import tempfile
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvhal import KVGeometry, get_kv_from_block, put_kv_into_block
from kvhal.geometry import KVFormat
from kvhal.layouts import BLHNC, LBHNC, KVLayout
from kvhal.offload.host_tier import HostTier
from kvhal.offload.manager import BlockState, OffloadingManager
from kvhal.registry import PluginRegistry
from kvhal.tiers.backend import OK, TierBackend, TierSpec
from kvhal.tiers.chain import ChainTier, LoadPlan, TierChain, TierRead, WritePlan
from kvhal.tiers.disk import DiskTier
from kvhal.tiers.disk.format import RECORD_BYTES
from kvhal.tiers.index import TierIndex
from kvhal.tiers.io import TierIO
from tests.helpers import examples

REGISTRY = PluginRegistry(autoload=False, allow=None, block=())
CPU = REGISTRY.select("cpu")
UNIVERSE = [b"key-%04d" % i for i in range(16)]
HOST_SLOTS = 6
DISK_SLOTS = 12
FINGERPRINT = {"model": "statemachine"}
DISK = "disk"  # the chain's one tier below the host tier


@dataclass(frozen=True)
class Variant:
    name: str
    geometry: KVGeometry  # one block
    layout: KVLayout
    write: str


# 1 KiB slots in two runs of 512 (a layer-major host view; disk slots padded to 4 KiB),
# and 4 KiB slots in one run (cross-layer; moved in place).
LAYER_MAJOR = KVGeometry(2, 1, 4, 2, 8, torch.float32, KVFormat.STACKED)
CROSS_LAYER = KVGeometry(2, 1, 4, 4, 8, torch.float32, KVFormat.STACKED)
VARIANTS = [
    Variant(f"{name}-{write}", geometry, layout, write)
    for name, geometry, layout in (("layer-major", LAYER_MAJOR, LBHNC), ("cross-layer", CROSS_LAYER, BLHNC))
    for write in ("through", "back")
]


class FaultyDisk(DiskTier):
    """A disk tier whose next calls fail as :attr:`fault` says."""

    fault: str | None = None  # "payload", "record" (after the payload: torn), "read"

    def _pwritev(self, fd, buffers, offset):
        if self.fault == "payload" and fd != self._index_fd:
            raise OSError(errno.EIO, "injected payload write error")
        super()._pwritev(fd, buffers, offset)

    def _write_records(self, first_slot, records):
        if self.fault == "record":
            raise OSError(errno.EIO, "injected record write error")
        super()._write_records(first_slot, records)

    def _preadv(self, fd, buffers, offset):
        if self.fault == "read" and fd != self._index_fd:
            raise OSError(errno.EIO, "injected read error")
        super()._preadv(fd, buffers, offset)


class Deferred(TierBackend):
    """Holds each write and read until :meth:`run` hands it to the disk tier.

    Within the backend contract (buffers stay valid until the future completes),
    and it keeps the machine deterministic while calls are in flight.
    """

    def __init__(self, inner: FaultyDisk) -> None:
        self.inner = inner
        self.num_slots = inner.num_slots
        self.calls: dict[Future, tuple] = {}
        self.last: Future | None = None  # the call just deferred (TierIO may wrap its future)

    def recover(self, progress=None):
        raise AssertionError("the io role never recovers")

    def write(self, slots, keys, buffers):
        return self._defer(self.inner.write, slots, keys, buffers)

    def read(self, slots, keys, buffers):
        return self._defer(self.inner.read, slots, keys, buffers)

    def _defer(self, call, *args) -> Future:
        outer: Future = Future()
        self.calls[outer] = (call, [list(a) for a in args])
        self.last = outer
        return outer

    def run(self, outer: Future, fault: str | None = None) -> None:
        call, args = self.calls.pop(outer)
        self.inner.fault = fault
        try:
            result = call(*args).result(timeout=30)
        finally:
            self.inner.fault = None
        outer.set_result(result)  # TierIO's scatter (a callback) runs here

    def close(self) -> None:
        self.inner.close()


def reference(key: bytes, geometry: KVGeometry) -> torch.Tensor:
    """The block a key names: random, fixed per key."""
    seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1
    g = torch.Generator().manual_seed(seed)
    shape = (geometry.num_layers, geometry.num_kv_heads, geometry.block_size, geometry.content_size(0))
    return torch.randn(shape, generator=g, dtype=geometry.dtype)


class ChainMachine(RuleBasedStateMachine):
    variant: Variant = VARIANTS[0]

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="kvhal-chain-sm-")
        self.geometry = self.variant.geometry
        self.refs = {key: reference(key, self.geometry) for key in UNIVERSE}
        self.disk: dict[int, tuple[bytes, bool]] = {}  # slot -> (key of its record, payload intact)
        self.index_tier: DiskTier | None = None
        self.io: FaultyDisk | None = None
        self.host_tier: HostTier | None = None
        self.open()

    # -- the system ----------------------------------------------------------------

    def spec(self, role: str) -> TierSpec:
        stride = -(-self.geometry.block_bytes // 4096) * 4096
        options = {"path": self.dir, "bytes_to_use": DISK_SLOTS * (stride + RECORD_BYTES), "io_threads": 2}
        return TierSpec(options, self.geometry.block_bytes, FINGERPRINT, role)  # type: ignore[arg-type]

    def open(self) -> None:
        """Start as an engine does: the scheduler opens the medium and recovers its index,
        the worker opens it for bytes; the host tier starts empty."""
        self.index_tier = DiskTier(self.spec("index"))
        assert self.index_tier.num_slots == DISK_SLOTS
        slots, keys = self.index_tier.recover()
        assert dict(zip(slots, keys, strict=True)) == {s: k for s, (k, _) in self.disk.items()}, (
            "recovery finds exactly the records on disk"
        )
        lower = TierIndex(DISK_SLOTS, "lru", registry=REGISTRY)
        lower.recover(slots, keys)
        self.host_tier = HostTier(CPU, HOST_SLOTS * self.geometry.block_bytes, self.geometry.block_bytes)
        self.view = self.host_tier.view(self.geometry.with_num_blocks(HOST_SLOTS), self.variant.layout)
        assert self.host_tier.slots_are_contiguous == (self.variant.layout is BLHNC)
        manager = OffloadingManager(self.host_tier.pool, "lru", registry=REGISTRY)
        self.chain = TierChain(manager, [ChainTier(DISK, lower, self.variant.write)])  # type: ignore[arg-type]
        self.io = FaultyDisk(self.spec("io"))
        self.backend = Deferred(self.io)
        self.tio = TierIO(self.host_tier, self.backend)
        # the model
        self.host: dict[bytes, str] = {}  # key -> "storing" | "ready"
        self.pins: Counter[bytes] = Counter()  # host loads in flight, write-through pins
        self.lower: dict[bytes, str] = dict.fromkeys(keys, "ready")  # "storing" | "ready"
        self.lower_pins: Counter[bytes] = Counter()
        self.lower_evicted = 0
        # in flight: the plan, TierIO's future, and the disk call it waits on
        self.loads: list[tuple[LoadPlan, Future | None, Future | None]] = []
        self.writes: list[tuple[WritePlan, Future, Future]] = []

    def close(self) -> None:
        for tier in (self.io, self.index_tier, self.host_tier):
            if tier is not None:
                tier.close()
        self.io = self.index_tier = self.host_tier = None

    def teardown(self) -> None:
        try:
            self.close()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)

    # -- helpers ---------------------------------------------------------------------

    @property
    def index(self) -> TierIndex:
        """The disk tier's index, as the chain keeps it."""
        index = self.chain.tier(DISK).index
        assert index is not None
        return index

    @staticmethod
    def disk_read(plan: LoadPlan) -> TierRead:
        """The plan's read from the disk tier (empty if it promotes nothing)."""
        assert [read.tier for read in plan.reads] in ([], [DISK]), "the chain's only tier below is the disk"
        return plan.reads[0] if plan.reads else TierRead(DISK, [], [], [])

    def check_slot(self, key: bytes, slot: int) -> None:
        got = get_kv_from_block(self.view, slot)
        assert torch.equal(got, self.refs[key]), f"host slot {slot} does not hold the bytes of {key!r}"

    def sync_evictions(self, host_evicted: list[bytes] | None = None) -> None:
        """Take the evictions a prepare call made; only idle ready blocks may go."""
        gone = [
            k for k, s in self.host.items() if s == "ready" and self.chain.host.state(k) is BlockState.ABSENT
        ]
        for key in gone:
            assert not self.pins[key], f"{key!r} was evicted from the host tier while pinned"
            del self.host[key]
        if host_evicted is not None:
            assert sorted(gone) == sorted(host_evicted)
        gone = [k for k, s in self.lower.items() if s == "ready" and self.index.state(k) is BlockState.ABSENT]
        for key in gone:
            assert not self.lower_pins[key], f"{key!r} was evicted from the disk tier while being read"
            del self.lower[key]
        self.lower_evicted += len(gone)
        assert self.chain.tier(DISK).evictions == self.lower_evicted

    def start_write(self, plan: WritePlan) -> None:
        assert plan.tier == DISK
        for key in plan.keys:
            if plan.snapshot:  # a write-through's keys were marked with its store
                assert key not in self.lower, f"{key!r} is written below twice"
                self.lower[key] = "storing"
        future = self.tio.write(plan.keys, plan.host_slots, plan.slots, plan.snapshot)
        self.writes.append((plan, future, self.backend.last))

    def start_write_backs(self) -> None:
        """Write-back snapshots, started before this step's copies reuse their slots."""
        for plan in self.chain.take_writes():
            assert plan.snapshot and self.variant.write == "back"
            assert not set(plan.keys) & set(self.host), "a write-back of a block still in the host tier"
            self.start_write(plan)

    def room(self, keys: list[bytes]) -> int:
        """Host slots free or evictable, the call's own ``keys`` kept."""
        evictable = sum(s == "ready" and not self.pins[k] and k not in keys for k, s in self.host.items())
        return HOST_SLOTS - len(self.host) + evictable

    # -- stores ----------------------------------------------------------------------

    def store(self, keys: list[bytes], fail: bool) -> None:
        new = [k for k in dict.fromkeys(keys) if k not in self.host]
        planned = self.chain.prepare_store(keys, [DISK])
        if planned is None:
            assert new and len(new) > self.room(keys), "a store with room was refused"
            return
        plan, writes = planned
        assert len(writes) <= 1, "one tier below, one write-through at most"
        write = writes[0] if writes else None
        assert plan.keys == new and len(new) <= self.room(keys)
        self.sync_evictions(plan.evicted)
        for key in plan.keys:
            self.host[key] = "storing"
        if write is not None:
            assert self.variant.write == "through"
            assert write.keys == [k for k in plan.keys if k not in self.lower], "write-through: new blocks"
            for key in write.keys:
                assert key not in self.lower
                self.lower[key] = "storing"
        self.start_write_backs()
        # the device copy into the host slots (a failed one leaves garbage in some)
        for i, (key, slot) in enumerate(zip(plan.keys, plan.slots, strict=True)):
            kv = self.refs[key] if not (fail and i % 2 == 0) else torch.zeros_like(self.refs[key])
            put_kv_into_block(self.view, slot, kv)
        self.chain.complete_store(plan.keys, success=not fail, writes=writes)
        for key in plan.keys:
            if fail:
                del self.host[key]
            else:
                self.host[key] = "ready"
        if write is None:
            return
        if fail:  # the worker never runs it; the scheduler fails it
            self.chain.complete_write(write, success=False)
            for key in write.keys:
                del self.lower[key]
            return
        assert write.pinned
        self.pins.update(write.keys)
        self.start_write(write)

    @rule(
        keys=st.lists(st.sampled_from(UNIVERSE), min_size=1, max_size=HOST_SLOTS),
        fail=st.sampled_from([False] * 5 + [True]),
    )
    def store_keys(self, keys: list[bytes], fail: bool) -> None:
        self.store(keys, fail)

    @rule(data=st.data())
    def pressure(self, data) -> None:
        """A request of fresh blocks as big as the host tier: evicts all it can."""
        self.pressure_with(data.draw(st.permutations([k for k in UNIVERSE if k not in self.host])))

    def pressure_with(self, fresh: list[bytes]) -> None:
        """:meth:`pressure` with ``fresh``, keys not in the host tier, in the order drawn."""
        assert not set(fresh) & set(self.host)
        self.store(fresh[:HOST_SLOTS], fail=False)

    @precondition(lambda self: self.writes)
    @rule(data=st.data(), fault=st.sampled_from([None, None, None, "payload", "record", "report"]))
    def finish_write(self, data, fault: str | None) -> None:
        self.finish_write_at(data.draw(st.integers(0, len(self.writes) - 1)), fault)

    def finish_write_at(self, i: int, fault: str | None) -> None:
        """The disk write, then the scheduler's completion (``"report"``: another rank failed)."""
        plan, future, call = self.writes.pop(i)
        self.backend.run(call, fault if fault != "report" else None)
        written = future.result()
        assert written == [fault in (None, "report")] * len(plan.keys)
        for key, slot in zip(plan.keys, plan.slots, strict=True):
            if fault in (None, "report"):
                self.disk[slot] = (key, True)
            elif fault == "record" and slot in self.disk:
                # The old record over the new payload: the key's bytes under the record of the
                # slot's last key, intact if that is this key (same key, same bytes, same crc).
                old = self.disk[slot][0]
                self.disk[slot] = (old, old == key)
        ok = fault is None
        self.chain.complete_write(plan, success=ok)
        for key in plan.keys:
            assert self.lower[key] == "storing"
            if ok:
                self.lower[key] = "ready"
            else:
                del self.lower[key]
        if not plan.snapshot:
            self.pins.subtract(plan.keys)

    # -- loads -----------------------------------------------------------------------

    @rule(data=st.data(), finish=st.booleans())
    def load(self, data, finish: bool) -> None:
        held = sorted(set(self.host) | set(self.lower)) or UNIVERSE  # mostly requests that hit
        keys = data.draw(st.lists(st.sampled_from(held), min_size=1, max_size=6, unique=True))
        if data.draw(st.booleans()):
            keys += [k for k in data.draw(st.permutations(UNIVERSE))[:3] if k not in keys]
        self.load_keys(keys, finish)

    def load_keys(self, keys: list[bytes], finish: bool) -> None:
        """A request for ``keys``: the lookup, the load of its hits, finished now if ``finish``."""
        hits, promoted = self.chain.lookup(keys)
        for key in keys[:hits]:
            assert self.host.get(key) == "ready" or self.lower.get(key) == "ready", f"{key!r} is nowhere"
        if hits < len(keys):
            stop = keys[hits]
            # a host hit ends the prefix only where it and the promotions before it cannot all fit
            assert self.host.get(stop) != "ready" or promoted, "the lookup stopped at a host hit"
            host_hits = sum(self.host.get(k) == "ready" for k in keys[:hits])
            if stop not in self.host and self.lower.get(stop) == "ready":
                assert promoted >= self.room([]) - host_hits, "the lookup stopped at a disk hit with room"
        if not hits:
            return
        keys = keys[:hits]
        plan = self.chain.prepare_load(keys)
        assert plan is not None, "a load the lookup offered was refused"
        read = self.disk_read(plan)
        assert read.keys == [k for k in keys if self.host.get(k) != "ready"]
        assert len(read.keys) == promoted
        self.pins.update(plan.host_hits)
        self.sync_evictions()
        for key in read.keys:
            assert self.lower[key] == "ready" and key not in self.host
            self.host[key] = "storing"
        self.lower_pins.update(read.keys)
        self.start_write_backs()  # before the reads land in the slots they reuse
        future = call = None
        if read.keys:
            future = self.tio.read(read.keys, read.slots, read.host_slots)
            call = self.backend.last
        self.loads.append((plan, future, call))
        if finish:
            self.finish(len(self.loads) - 1, None)

    @precondition(lambda self: self.loads)
    @rule(data=st.data(), fault=st.sampled_from([None, None, None, "read"]))
    def finish_load(self, data, fault: str | None) -> None:
        self.finish(data.draw(st.integers(0, len(self.loads) - 1)), fault)

    def finish(self, i: int, fault: str | None) -> None:
        """The reads, then the device load of every block: each must be the key's."""
        plan, future, call = self.loads.pop(i)
        read = self.disk_read(plan)
        ok = True
        if future is not None:
            self.backend.run(call, fault)
            outcomes = future.result()
            for key, lower_slot, host_slot, outcome in zip(
                read.keys, read.slots, read.host_slots, outcomes, strict=True
            ):
                intact = self.disk.get(lower_slot) == (key, True) and fault is None
                assert (outcome is OK) == intact, f"read of {key!r} from disk slot {lower_slot}: {outcome}"
                if outcome is OK:
                    self.check_slot(key, host_slot)
            ok = all(outcome is OK for outcome in outcomes)
        for key, slot in zip(plan.keys, plan.host_slots, strict=True):
            if ok or key not in read.keys:
                self.check_slot(key, slot)  # what the device load delivers
        self.chain.complete_load(plan, success=ok)
        self.pins.subtract(plan.host_hits)
        self.lower_pins.subtract(read.keys)
        for key in read.keys:
            if ok:
                self.host[key] = "ready"
            else:  # gone from both tiers: the engine recomputes it
                del self.host[key]
                del self.lower[key]

    # -- the medium ------------------------------------------------------------------

    @precondition(lambda self: any(intact for _, intact in self.disk.values()))
    @rule(data=st.data())
    def corrupt(self, data) -> None:
        """Flip a byte of a stored payload: a read of it must fail, never deliver it."""
        slot = data.draw(st.sampled_from(sorted(s for s, (_, intact) in self.disk.items() if intact)))
        where = data.draw(st.integers(0, self.geometry.block_bytes - 1))
        self.corrupt_slot(slot, where, data.draw(st.integers(1, 255)))

    def corrupt_slot(self, slot: int, where: int, flip: int) -> None:
        """XOR the payload byte ``where`` of ``slot`` (an intact one) with ``flip``."""
        assert self.disk[slot][1] and self.io is not None
        file, offset = self.io.geometry.locate(slot)
        path = os.path.join(self.io.namespace, "rank0of1", f"data-{file}.bin")
        fd = os.open(path, os.O_RDWR)
        try:
            byte = os.pread(fd, 1, offset + where)[0]
            os.pwrite(fd, bytes([byte ^ flip]), offset + where)
        finally:
            os.close(fd)
        self.disk[slot] = (self.disk[slot][0], False)

    @rule(crash=st.booleans())
    def restart(self, crash: bool) -> None:
        """Stop (finishing what is in flight, or crashing before it ran) and start again:
        what the disk holds is found again; host memory is lost."""
        if not crash:
            while self.loads:
                self.finish(0, None)
            while self.writes:
                self.finish_write_at(0, None)
        self.close()
        self.open()

    # -- invariants ------------------------------------------------------------------

    @invariant()
    def matches_model(self) -> None:
        chain = self.chain
        for key in UNIVERSE:
            host = chain.host.state(key)
            assert host.value == self.host.get(key, "absent"), (
                f"{key!r}: host {host}, model {self.host.get(key)}"
            )
            assert chain.host.loads_in_flight(key) == self.pins[key], f"{key!r}: host pins"
            lower = self.index.state(key)
            assert lower.value == self.lower.get(key, "absent"), (
                f"{key!r}: disk {lower}, model {self.lower.get(key)}"
            )
            assert self.index.loads_in_flight(key) == self.lower_pins[key], f"{key!r}: disk pins"
            if chain.lookup([key])[0]:
                assert self.host.get(key) == "ready" or self.lower.get(key) == "ready"
            if lower is BlockState.READY:
                assert self.disk[self.index.slot(key)][0] == key, "the index points at another key's slot"
            if host is BlockState.READY:
                self.check_slot(key, chain.host.slot(key))
        if not self.loads and not self.writes:
            assert (
                not +self.pins
                and not +self.lower_pins
                and chain.host.num_evictable == sum(s == "ready" for s in self.host.values())
            ), "pins left behind"


SETTINGS = settings(
    max_examples=examples(25),
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@pytest.mark.parametrize("variant", VARIANTS, ids=[v.name for v in VARIANTS])
def test_chain_matches_the_reference_model(variant: Variant) -> None:
    machine = type(f"ChainMachine_{variant.name}", (ChainMachine,), {"variant": variant})
    run_state_machine_as_test(machine, settings=SETTINGS)


def test_a_torn_rewrite_under_its_own_old_record_reads_intact() -> None:
    """Issue 35's shrunk example, step by step (no hypothesis database needed).

    key-0000 goes to disk slot 0, its payload is corrupted there, a read of it fails
    (so the chain drops it), and it is stored again into slot 0, where the payload is
    written and the record write fails (keys 1 and 2 alongside, in slots 1 and 2). The
    old record names key-0000 with the crc of key-0000's bytes, and the payload is
    key-0000's bytes again: after a restart the slot reads as key-0000, intact, with the
    key's own bytes. (The model said not intact.)
    """
    variant = next(v for v in VARIANTS if v.name == "cross-layer-through")
    m = type("ChainMachine_issue35", (ChainMachine,), {"variant": variant})()
    key = UNIVERSE[0]
    steps = [
        lambda: m.restart(crash=False),
        lambda: m.pressure_with(UNIVERSE),  # keys 0-5 to the host tier and, written through, to disk
        lambda: m.pressure_with(UNIVERSE[6:]),  # refused: every host slot is pinned by its write
        lambda: m.pressure_with(UNIVERSE[6:]),
        lambda: m.restart(crash=False),  # the writes finish: keys 0-5 in disk slots 0-5
        *(lambda slot=slot: m.corrupt_slot(slot, 0, 1) for slot in range(5)),
        lambda: m.load_keys(UNIVERSE[:3], finish=True),  # keys 0-2 read corrupt: dropped from both tiers
        lambda: m.pressure_with(UNIVERSE),  # keys 0-2 are written through again, into slots 0-2
        lambda: m.finish_write_at(0, "record"),  # payloads written, the record write fails
        lambda: m.restart(crash=False),  # recovery finds slot 0's old record: key-0000
        lambda: m.load_keys([key], finish=True),  # the read: key-0000's own bytes, intact
    ]
    try:
        m.matches_model()
        for step in steps:
            step()
            m.matches_model()
        assert m.disk[0] == (key, True) and m.host.get(key) == "ready"
    finally:
        m.teardown()


@pytest.mark.parametrize("variant", VARIANTS[::3], ids=[v.name for v in VARIANTS[::3]])
def test_the_machine_catches_swapped_blocks(variant: Variant, monkeypatch) -> None:
    """Negative control: a read that puts two promoted blocks in each other's host slots."""
    read = TierIO.read

    def swapped(self, keys, lower_slots, host_slots):
        host_slots = list(host_slots)
        if len(host_slots) >= 2:
            host_slots[0], host_slots[1] = host_slots[1], host_slots[0]
        return read(self, keys, lower_slots, host_slots)

    monkeypatch.setattr(TierIO, "read", swapped)
    machine = type(f"SwappedMachine_{variant.name}", (ChainMachine,), {"variant": variant})
    hunt = settings(SETTINGS, max_examples=200, phases=[Phase.generate], database=None)
    with pytest.raises(AssertionError, match="does not hold the bytes"):
        run_state_machine_as_test(machine, settings=hunt)
