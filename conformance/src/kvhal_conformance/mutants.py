"""Mutants: the built-in CPU plugin with one clause of the map broken each.

Each mutant is a realistic defect (a fast path that skips the stream, an event
pool that hands out busy events, an allocator that rounds the wrong way) that
breaks the clauses it names in ``breaks``; ``also`` names clauses its defect
breaks as a consequence (and why). Running the suite against every mutant
(:mod:`kvhal_conformance.mutation`) proves each check can fail, and shows the
clauses no mutant reaches.

These are plugins for testing the suite, not for use: run one with
``kvhal conformance --device mutant --plugin kvhal_conformance.mutants:NAME``.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvhal.cache import KVCache, allocate_dense_kv_cache
from kvhal.copyplan import CopyPlan
from kvhal.cpu import CPUPlugin, memory
from kvhal.cpu.streams import CPUEvent, CPUStream, InlineStream, _Marker, _State, _worker
from kvhal.descriptor import Capability, DeviceDescriptor, Refusal
from kvhal.errors import TransferError
from kvhal.geometry import KVFormat, KVGeometry
from kvhal.hookspecs import hookimpl
from kvhal.layouts import KVLayout

Stream = CPUStream | InlineStream
#: Copies below this many bytes take a mutant's "small copy" path.
SMALL = 64 << 10
#: Allocations from this size take a mutant's "large" path (the suite's caches, host tiers and
#: throughput batches exceed it at every size preset; its busy scratch does not).
LARGE = 8 << 20
#: ``also`` of a plugin that cannot be bound: every check needing the device fails.
EVERY_CLAUSE = "*"


@dataclass(frozen=True)
class Mutant:
    """A broken plugin and the clauses the suite must find broken.

    :param name: the class name (``--plugin kvhal_conformance.mutants:NAME``).
    :param plugin: the plugin class.
    :param breaks: clauses the suite must report broken (every one of them).
    :param also: clauses it may report broken too, as a consequence of the defect.
    :param why: why those are broken too.
    :param floor: the throughput floor to run with (None: 0, throughput not judged).
    """

    name: str
    plugin: type
    breaks: tuple[str, ...]
    also: tuple[str, ...] = ()
    why: str = ""
    floor: float | None = None

    @property
    def defect(self) -> str:
        return " ".join((self.plugin.__doc__ or "").strip().split("\n\n")[0].split())


MUTANTS: dict[str, Mutant] = {}


def mutant(
    *breaks: str, also: Sequence[str] = (), why: str = "", floor: float | None = None
) -> Callable[[type], type]:
    def register(cls: type) -> type:
        MUTANTS[cls.__name__] = Mutant(cls.__name__, cls, tuple(breaks), tuple(also), why, floor)
        return cls

    return register


def reached(mutants: dict[str, Mutant]) -> dict[str, list[str]]:
    """Clause id -> the mutants that break it."""
    found: dict[str, list[str]] = {}
    for m in mutants.values():
        for clause in m.breaks:
            found.setdefault(clause, []).append(m.name)
    return found


def _copy(engine: Any, plan: CopyPlan) -> Callable[[], None]:
    def run() -> None:
        engine.run(*plan.descriptors)  # the closure keeps the plan, and its caches' memory, alive

    return run


def _record_after(stream: Stream, work: Callable[[], None]) -> CPUEvent:
    stream.submit(work)
    done = CPUEvent()
    stream.record(done)
    return done


def _storage_end(cache: KVCache) -> int:
    return max(address + size for address, size in cache.storage_spans)


def _replace_caps(
    descriptor: DeviceDescriptor | Refusal, add: set[str] = frozenset(), drop: set[str] = frozenset()
) -> Any:
    assert isinstance(descriptor, DeviceDescriptor)
    caps = (set(descriptor.capabilities) - set(drop)) | set(add)
    return dataclasses.replace(descriptor, capabilities=frozenset(caps))


# -- the plugin as a whole ------------------------------------------------------------


@mutant(
    "plugin.hooks", also=(EVERY_CLAUSE,), why="a plugin that cannot be bound fails every check needing it"
)
class MissingQueryHook(CPUPlugin):
    """Does not implement kvhal_query_event (a port that only ever synchronizes)."""

    kvhal_query_event = None


@mutant("probe.result")
class ProbeFailsWhenCalledAgain(CPUPlugin):
    """The probe initializes the driver and raises "already initialized" when called again
    after selection (kvhal probes a plugin twice to bind it)."""

    def __init__(self) -> None:
        super().__init__()
        self._probes = 0

    @hookimpl
    def kvhal_probe(self) -> DeviceDescriptor | Refusal:
        self._probes += 1
        if self._probes > 2:
            raise RuntimeError("driver already initialized")
        return super().kvhal_probe()


@mutant("probe.descriptor")
class TypoCapability(CPUPlugin):
    """Declares ``copy.batch`` for ``copy.batched`` (a typo kvhal cannot act on)."""

    @hookimpl
    def kvhal_probe(self) -> DeviceDescriptor | Refusal:
        return _replace_caps(super().kvhal_probe(), add={"copy.batch"}, drop={Capability.BATCHED_COPY.value})


@mutant("probe.no_work")
class ProbeKeepsStream(CPUPlugin):
    """Each probe creates a copy stream to check the device works, and keeps it (its thread
    keeps running)."""

    def __init__(self) -> None:
        super().__init__()
        self._probe_streams: list[CPUStream] = []

    @hookimpl
    def kvhal_probe(self) -> DeviceDescriptor | Refusal:
        self._probe_streams.append(CPUStream("kvhal-probe-check"))
        return super().kvhal_probe()


# -- layouts -------------------------------------------------------------------------


@mutant("layouts.sequence")
class NoLayoutsForGPUBackends(CPUPlugin):
    """Answers None for attention backend names it does not know (only for None and CPU names)."""

    @hookimpl
    def kvhal_kv_layouts(self, attention_backend: str | None) -> Sequence[KVLayout] | None:
        if attention_backend is not None and not attention_backend.upper().startswith(("CPU", "TORCH")):
            return None
        return super().kvhal_kv_layouts(attention_backend)


class _Tiled(KVLayout):
    """A hand-made layout that skips KVLayout's own validation."""

    def __post_init__(self) -> None:
        pass


@mutant("layouts.permutation")
class RepeatedDimForFlashInfer(CPUPlugin):
    """For FLASHINFER, adds a tiled layout whose stride order repeats N (a 5-tuple, but no C)."""

    @hookimpl
    def kvhal_kv_layouts(self, attention_backend: str | None) -> Sequence[KVLayout]:
        layouts = tuple(super().kvhal_kv_layouts(attention_backend))
        if attention_backend == "FLASHINFER":
            return (*layouts, _Tiled("LBHN-tiled", (0, 1, 2, 3, 3)))
        return layouts


@mutant("layouts.cross_layer")
class UndeclaredCrossLayer(CPUPlugin):
    """Offers cross-layer layouts but forgets to declare ``layout.cross_layer``."""

    @hookimpl
    def kvhal_probe(self) -> DeviceDescriptor | Refusal:
        return _replace_caps(super().kvhal_probe(), drop={Capability.CROSS_LAYER.value})


# -- allocation ------------------------------------------------------------------------


#: The dtypes the mutant's allocation table knows; others fall back to float16.
_KNOWN = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn)


@mutant("alloc.as_asked", also=("alloc.refuses",), why="undeclared dtypes are allocated as float16 too")
class DeclaredDtypeAllocatedAsHalf(CPUPlugin):
    """Declares ``dtype.float8_e5m2``, but its allocation table does not know it and allocates
    float16 instead."""

    @hookimpl
    def kvhal_probe(self) -> DeviceDescriptor | Refusal:
        return _replace_caps(super().kvhal_probe(), add={"dtype.float8_e5m2"})

    @hookimpl
    def kvhal_allocate_kv_cache(
        self, geometry: KVGeometry, layout: KVLayout, device: torch.device
    ) -> KVCache:
        if geometry.dtype not in _KNOWN:
            geometry = dataclasses.replace(geometry, dtype=torch.float16)
        return super().kvhal_allocate_kv_cache(geometry, layout, device)


@mutant("alloc.zeroed")
class ZeroesOnlyFirst8MiB(CPUPlugin):
    """Clears new caches with a kernel whose grid covers at most 8 MiB: the rest of a larger
    cache keeps what the memory held (here: 0x5A)."""

    @hookimpl
    def kvhal_allocate_kv_cache(
        self, geometry: KVGeometry, layout: KVLayout, device: torch.device
    ) -> KVCache:
        cache = super().kvhal_allocate_kv_cache(geometry, layout, device)
        for buffer in cache.storage:
            if buffer.numel() > LARGE:
                buffer[LARGE:].fill_(0x5A)
        return cache


@mutant("alloc.layout")
class SeparateLayerBuffers(CPUPlugin):
    """Allocates every layer of a layer-separate cache as its own buffer (of a size rounded
    up per layer), not one buffer laid out in the layout."""

    @hookimpl
    def kvhal_allocate_kv_cache(
        self, geometry: KVGeometry, layout: KVLayout, device: torch.device
    ) -> KVCache:
        if layout.is_cross_layer:
            return super().kvhal_allocate_kv_cache(geometry, layout, device)
        one = dataclasses.replace(geometry, num_layers=1)
        layers, storage = [], []
        for layer in range(geometry.num_layers):
            cache = allocate_dense_kv_cache(one, layout, device, alignment=4096 * (layer + 1))
            layers.append(cache.layers[0])
            storage += cache.storage
        return KVCache(geometry, layout, tuple(layers), tuple(storage))


@mutant(
    "alloc.cross_layer",
    also=("copy.data", "copy.dst_only", "copy.src_unchanged"),
    why="kvhal refuses to copy between its padded caches and dense host caches of the same layout",
)
class PaddedCrossLayer(CPUPlugin):
    """Pads every layer of a cross-layer block with one spare head, so one block of all
    layers is no longer one contiguous region."""

    @hookimpl
    def kvhal_allocate_kv_cache(
        self, geometry: KVGeometry, layout: KVLayout, device: torch.device
    ) -> KVCache:
        if not layout.is_cross_layer:
            return super().kvhal_allocate_kv_cache(geometry, layout, device)
        padded = allocate_dense_kv_cache(
            dataclasses.replace(geometry, num_kv_heads=geometry.num_kv_heads + 1), layout, device
        )
        heads = geometry.num_kv_heads
        layers = tuple(tuple(view[:, :heads] for view in parts) for parts in padded.layers)
        return KVCache(geometry, layout, layers, padded.storage)


@mutant(
    "alloc.distinct",
    also=("copy.data", "copy.dst_only", "copy.src_unchanged"),
    why="copies of split caches read and write K and V through the same memory",
)
class SplitPartsShareMemory(CPUPlugin):
    """Hands out the K view as the V view too in split (K, V) caches."""

    @hookimpl
    def kvhal_allocate_kv_cache(
        self, geometry: KVGeometry, layout: KVLayout, device: torch.device
    ) -> KVCache:
        cache = super().kvhal_allocate_kv_cache(geometry, layout, device)
        if geometry.kv_format is not KVFormat.SPLIT or geometry.head_size != geometry.head_size_v:
            return cache
        return KVCache(geometry, layout, tuple((k, k) for k, _ in cache.layers), cache.storage)


@mutant("alloc.refuses")
class SplitNotImplemented(CPUPlugin):
    """Does not declare ``kv.split`` and raises NotImplementedError when asked for a split cache."""

    @hookimpl
    def kvhal_probe(self) -> DeviceDescriptor | Refusal:
        return _replace_caps(super().kvhal_probe(), drop={Capability.SPLIT_KV.value})

    @hookimpl
    def kvhal_allocate_kv_cache(
        self, geometry: KVGeometry, layout: KVLayout, device: torch.device
    ) -> KVCache:
        if geometry.kv_format is KVFormat.SPLIT:
            raise NotImplementedError("split K/V caches")
        return super().kvhal_allocate_kv_cache(geometry, layout, device)


# -- host memory -------------------------------------------------------------------------


@mutant("host.buffer")
class BuffersRoundedDownTo64(CPUPlugin):
    """Hands out host buffers of ``nbytes & ~63`` bytes (an allocator granularity applied the
    wrong way): odd sizes come back short."""

    @hookimpl
    def kvhal_allocate_host_buffer(self, nbytes: int) -> torch.Tensor:
        return super().kvhal_allocate_host_buffer(nbytes)[: nbytes & ~63]


@mutant("host.aligned")
class MisalignedLargeBuffers(CPUPlugin):
    """Host buffers of 1 MiB or more start 64 bytes into a page (an allocator aligning to 64)."""

    @hookimpl
    def kvhal_allocate_host_buffer(self, nbytes: int) -> torch.Tensor:
        if nbytes < 1 << 20:
            return super().kvhal_allocate_host_buffer(nbytes)
        return super().kvhal_allocate_host_buffer(nbytes + 64)[64:]


class RecyclesFreedBuffers(CPUPlugin):
    """Keeps freed host buffers of at least ``recycle_bytes`` and hands them out again,
    uncleared, for the same size (a base of defects, not a mutant itself)."""

    recycle_bytes = 0

    def __init__(self) -> None:
        super().__init__()
        self._freed: dict[int, list[torch.Tensor]] = {}

    @hookimpl
    def kvhal_allocate_host_buffer(self, nbytes: int) -> torch.Tensor:
        pool = self._freed.get(nbytes)
        return pool.pop() if pool else super().kvhal_allocate_host_buffer(nbytes)

    @hookimpl
    def kvhal_free_host_buffer(self, buffer: torch.Tensor) -> None:
        if buffer.numel() >= self.recycle_bytes:
            self._freed.setdefault(buffer.numel(), []).append(buffer)
        else:
            super().kvhal_free_host_buffer(buffer)


@mutant("host.zeroed")
class RecyclesLargeBuffersDirty(RecyclesFreedBuffers):
    """Keeps freed host buffers of 8 MiB or more and hands them out again, uncleared, for the
    same size (a cache for host tiers)."""

    recycle_bytes = LARGE


@mutant("host.distinct")
class SlabRoundsDown(CPUPlugin):
    """Carves host buffers under 1 MiB from a locked slab, advancing by the size rounded
    *down* to pages: a buffer's odd tail is the next buffer's head."""

    SLAB = 64 << 20

    def __init__(self) -> None:
        super().__init__()
        self._slab: torch.Tensor | None = None
        self._offset = 0
        self._lock = threading.Lock()

    @hookimpl
    def kvhal_allocate_host_buffer(self, nbytes: int) -> torch.Tensor:
        if nbytes >= 1 << 20:
            return super().kvhal_allocate_host_buffer(nbytes)
        with self._lock:
            if self._slab is None or self._offset + nbytes + 4096 > self.SLAB:
                self._slab, self._offset = memory.allocate(self.SLAB, self.lock_policy()), 0
            buffer = self._slab[self._offset : self._offset + nbytes]
            self._offset += nbytes // 4096 * 4096
        buffer.zero_()
        return buffer

    def _in_slab(self, buffer: torch.Tensor) -> bool:
        slab = self._slab
        return slab is not None and slab.data_ptr() <= buffer.data_ptr() < slab.data_ptr() + slab.numel()

    @hookimpl
    def kvhal_free_host_buffer(self, buffer: torch.Tensor) -> None:
        if not self._in_slab(buffer):
            super().kvhal_free_host_buffer(buffer)

    @hookimpl
    def kvhal_host_buffer_is_pinned(self, buffer: torch.Tensor) -> bool:
        if self._in_slab(buffer):
            return self.lock_policy().lock
        return super().kvhal_host_buffer_is_pinned(buffer)


@mutant("host.pinned")
class NeverPins(CPUPlugin):
    """Declares ``host.pinned`` but never locks a buffer (the locking call was left out)."""

    @hookimpl
    def kvhal_probe(self) -> DeviceDescriptor | Refusal:
        return _replace_caps(super().kvhal_probe(), add={Capability.PINNED_HOST.value})

    @hookimpl
    def kvhal_allocate_host_buffer(self, nbytes: int) -> torch.Tensor:
        return memory.allocate(nbytes, memory.LockPolicy(False, "the locking call was left out"))


@mutant("free.release")
class FreeRefusesOddSizes(CPUPlugin):
    """Unlocks with a page-multiple size check: freeing a buffer of an odd size raises."""

    @hookimpl
    def kvhal_free_host_buffer(self, buffer: torch.Tensor) -> None:
        if buffer.numel() % memory.PAGE:
            raise ValueError(f"cannot unlock {buffer.numel()} bytes: not a multiple of the page size")
        super().kvhal_free_host_buffer(buffer)


@mutant("pinned.bool")
class PinnedAnswersInt(CPUPlugin):
    """Answers the driver's int (1 or 0) instead of a bool."""

    @hookimpl
    def kvhal_host_buffer_is_pinned(self, buffer: torch.Tensor) -> int:
        return int(memory.is_locked(buffer))


@mutant("pinned.truthful")
class PinnedLiar(CPUPlugin):
    """kvhal_host_buffer_is_pinned answers True for any tensor."""

    @hookimpl
    def kvhal_host_buffer_is_pinned(self, buffer: torch.Tensor) -> bool:
        return True


# -- streams and events ---------------------------------------------------------------------


@mutant("stream.new")
class OneSharedStream(CPUPlugin):
    """Hands out one shared copy stream from kvhal_create_stream."""

    def __init__(self) -> None:
        super().__init__()
        self._shared = CPUStream("kvhal-shared")

    @hookimpl
    def kvhal_create_stream(self, device: torch.device) -> CPUStream:
        return self._shared


class _TwoWorkerStream(CPUStream):
    """A "stream" served by two threads taking from one queue: work may overtake work."""

    def __init__(self) -> None:
        super().__init__("kvhal-two-workers-a")
        threading.Thread(target=_worker, args=(self._state,), name="kvhal-two-workers-b", daemon=True).start()


@mutant(
    "stream.order",
    also=(
        "copy.ordering",
        "wait.orders",
        "copy.event",
        "record.after_work",
        "record.again",
        "copy.on_stream",
        "query.state",
        "sync.waits",
        "copy.data",
        "copy.dst_only",
        "copy.error",
        "sync.error",
        "query.error",
    ),
    why="with two threads taking work from one stream, copies, event records and waits overtake each other",
)
class ThreadPoolStream(CPUPlugin):
    """Runs each stream's work on two threads taking from its queue (a thread pool as a stream)."""

    @hookimpl
    def kvhal_create_stream(self, device: torch.device) -> CPUStream:
        return _TwoWorkerStream()


@mutant("current.compute")
class FreshComputeStream(CPUPlugin):
    """Answers kvhal_current_stream with a new stream: nothing is ordered after compute."""

    @hookimpl
    def kvhal_current_stream(self, device: torch.device) -> CPUStream:
        return CPUStream()


@mutant("event.new")
class OneSharedEvent(CPUPlugin):
    """Hands out one shared event from kvhal_create_event (an event pool of one)."""

    def __init__(self) -> None:
        super().__init__()
        self._event = CPUEvent()

    @hookimpl
    def kvhal_create_event(self, device: torch.device) -> CPUEvent:
        return self._event


@mutant(
    "record.after_work", also=("record.again",), why="the second record of an event completes at once too"
)
class RecordCompletesAtOnce(CPUPlugin):
    """kvhal_record_event marks the event complete at once, as on the compute stream."""

    @hookimpl
    def kvhal_record_event(self, event: CPUEvent, stream: Stream) -> None:
        InlineStream().record(event)


class _InFlight:
    """The task a stream's worker runs now (its completion), shared with the worker."""

    task_done: threading.Event | None = None


class _InFlightStream(CPUStream):
    """A CPU stream that knows which of its tasks is running (a hardware queue's in-flight
    fence)."""

    def __init__(self) -> None:
        super().__init__("kvhal-in-flight")
        self.in_flight = _InFlight()

    def submit(self, task: Callable[[], None]) -> None:
        in_flight = self.in_flight  # not self: queued work must not keep the stream alive

        def run() -> None:
            finished = threading.Event()
            in_flight.task_done = finished
            try:
                task()
            finally:
                finished.set()

        super().submit(run)


@mutant("record.after_work", also=("record.again",), why="the second record follows only running work too")
class RecordFollowsRunningWork(CPUPlugin):
    """kvhal_record_event makes the event follow the work its stream runs now, not the work
    still queued behind it (the fence of what was dispatched, not of what was submitted)."""

    @hookimpl
    def kvhal_create_stream(self, device: torch.device) -> CPUStream:
        return _InFlightStream()

    @hookimpl
    def kvhal_record_event(self, event: CPUEvent, stream: Stream) -> None:
        if not isinstance(stream, _InFlightStream):
            stream.record(event)
            return
        marker = _Marker()
        event._marker = marker
        fence = stream.in_flight.task_done
        if fence is None or fence.is_set():
            marker.done.set()
            return
        threading.Thread(target=lambda: (fence.wait(), marker.done.set()), daemon=True).start()


@mutant("record.completes")
class IdleRecordNeedsSync(CPUPlugin):
    """An event recorded on a copy stream with nothing queued never queries complete; only a
    synchronize notices it (the worker is woken by new work or a blocking wait only)."""

    @hookimpl
    def kvhal_record_event(self, event: CPUEvent, stream: Stream) -> None:
        idle = isinstance(stream, CPUStream) and stream._state.tasks.empty()
        super().kvhal_record_event(event, stream)
        event.unnoticed = idle  # type: ignore[attr-defined]

    @hookimpl
    def kvhal_query_event(self, event: CPUEvent) -> bool:
        return False if getattr(event, "unnoticed", False) else super().kvhal_query_event(event)

    @hookimpl
    def kvhal_synchronize_event(self, event: CPUEvent) -> None:
        super().kvhal_synchronize_event(event)
        event.unnoticed = False  # type: ignore[attr-defined]


@mutant("record.again")
class RecordKeepsFirst(CPUPlugin):
    """Ignores a second record of an event: it keeps referring to its first."""

    @hookimpl
    def kvhal_record_event(self, event: CPUEvent, stream: Stream) -> None:
        if event._marker is None:
            super().kvhal_record_event(event, stream)


@mutant("query.state", also=("query.error",), why="a query that always answers True never raises either")
class QueryAlwaysTrue(CPUPlugin):
    """kvhal_query_event answers True for any event (it checks that the event was recorded,
    not that it was reached)."""

    @hookimpl
    def kvhal_query_event(self, event: CPUEvent) -> bool:
        return True


@mutant("query.nonblocking")
class QuerySynchronizes(CPUPlugin):
    """kvhal_query_event synchronizes the event, then answers True."""

    @hookimpl
    def kvhal_query_event(self, event: CPUEvent) -> bool:
        event.synchronize()
        return True


@mutant("query.error")
class QueryHidesError(CPUPlugin):
    """kvhal_query_event answers whether the event was reached and never raises its error."""

    @hookimpl
    def kvhal_query_event(self, event: CPUEvent) -> bool:
        marker = event._marker
        return marker is None or marker.done.is_set()


@mutant(
    "sync.waits",
    also=("sync.error",),
    why="a synchronize that does not wait cannot report the copy's failure",
)
class SyncReturnsEarly(CPUPlugin):
    """kvhal_synchronize_event returns at once for an event not yet reached (it only raises
    the error of one that was)."""

    @hookimpl
    def kvhal_synchronize_event(self, event: CPUEvent) -> None:
        event.query()  # raises the error of an event already reached; never waits


@mutant("sync.error")
class SyncHidesError(CPUPlugin):
    """kvhal_synchronize_event waits but swallows the copy's failure."""

    @hookimpl
    def kvhal_synchronize_event(self, event: CPUEvent) -> None:
        with contextlib.suppress(TransferError):
            event.synchronize()


@mutant("wait.orders", also=("record.again",), why="the re-recorded event's follower does not wait either")
class NoOpWait(CPUPlugin):
    """kvhal_stream_wait_event does nothing: the waiting stream runs on at once."""

    @hookimpl
    def kvhal_stream_wait_event(self, stream: Stream, event: CPUEvent) -> None:
        return None


@mutant("wait.nonblocking")
class WaitBlocksCaller(CPUPlugin):
    """kvhal_stream_wait_event synchronizes the event on the caller's thread (order is kept)."""

    @hookimpl
    def kvhal_stream_wait_event(self, stream: Stream, event: CPUEvent) -> None:
        event.synchronize()


# -- copies -----------------------------------------------------------------------------------


@mutant("copy.data")
class DropsTail(CPUPlugin):
    """Copies in 64-byte vectors and drops each descriptor's remainder (no tail loop): only
    sizes that are no multiple of 64 bytes lose bytes."""

    @hookimpl
    def kvhal_copy_blocks(self, plan: CopyPlan, stream: Stream) -> CPUEvent:
        engine = self.engine

        def copy() -> None:
            src, dst, sizes = plan.descriptors
            engine.run(src, dst, sizes // 64 * 64)

        return _record_after(stream, copy)


@mutant(
    "copy.dst_only",
    also=("copy.data",),
    why="the byte past a block lands in the next block of the mapping when that one was written first",
)
class WritesOnePastEnd(CPUPlugin):
    """Copies ``size + 1`` bytes per descriptor (an inclusive bound), where the byte after
    still lies in both caches' memory."""

    @hookimpl
    def kvhal_copy_blocks(self, plan: CopyPlan, stream: Stream) -> CPUEvent:
        engine = self.engine

        def copy() -> None:
            src_end, dst_end = _storage_end(plan.src), _storage_end(plan.dst)
            src, dst, sizes = plan.descriptors
            inside = (src + sizes < src_end) & (dst + sizes < dst_end)
            engine.run(src, dst, sizes + inside.astype(np.int64))

        return _record_after(stream, copy)


class MovesSources(CPUPlugin):
    """Moves copies of fewer than ``move_below`` bytes instead of copying them: their source is
    cleared afterwards (a base of defects, not a mutant itself)."""

    move_below: float = 0

    @hookimpl
    def kvhal_copy_blocks(self, plan: CopyPlan, stream: Stream) -> CPUEvent:
        engine = self.engine

        def move() -> None:
            src, dst, sizes = plan.descriptors
            engine.run(src, dst, sizes)
            if int(sizes.sum()) < self.move_below:
                for address, size in zip(src.tolist(), sizes.tolist(), strict=True):
                    ctypes.memset(address, 0, size)

        return _record_after(stream, move)


@mutant("copy.src_unchanged")
class ClearsSmallSources(MovesSources):
    """Moves small copies instead of copying them: the source is cleared afterwards."""

    move_below = SMALL


@mutant(
    "copy.ordering",
    also=("wait.orders", "record.again", "copy.error"),
    why="an inline copy also runs ahead of what its stream waits for, and raises its failure on the caller",
)
class InlineSmallCopies(CPUPlugin):
    """Runs copies under 64 KiB on the caller's thread at once (a fast path), ahead of the work
    already queued on the stream."""

    @hookimpl
    def kvhal_copy_blocks(self, plan: CopyPlan, stream: Stream) -> CPUEvent:
        src, dst, sizes = plan.descriptors
        if int(sizes.sum()) < SMALL:
            self.engine.run(src, dst, sizes)
            done = CPUEvent()
            stream.record(done)
            return done
        return super().kvhal_copy_blocks(plan, stream)


@mutant(
    "copy.on_stream",
    also=("record.again",),
    why="an event recorded after the copy, first or second time, does not follow it",
)
class PrivateCopyStream(CPUPlugin):
    """Runs copies on a private stream that waits for the given stream, but never makes the
    given stream wait back (a fork without a join)."""

    def __init__(self) -> None:
        super().__init__()
        self._private = CPUStream("kvhal-private")

    @hookimpl
    def kvhal_copy_blocks(self, plan: CopyPlan, stream: Stream) -> CPUEvent:
        forked = CPUEvent()
        stream.record(forked)
        self._private.wait_event(forked)
        return super().kvhal_copy_blocks(plan, self._private)


@mutant("copy.event", also=("copy.error",), why="an event that is complete at once cannot carry the failure")
class CompleteEventForSmallCopies(CPUPlugin):
    """Returns an unrecorded (complete) event for copies under 64 KiB, assuming they are done
    at once; the copy itself is queued on the stream as it should be."""

    @hookimpl
    def kvhal_copy_blocks(self, plan: CopyPlan, stream: Stream) -> CPUEvent:
        if plan.num_bytes < SMALL:
            stream.submit(_copy(self.engine, plan))
            return CPUEvent()
        return super().kvhal_copy_blocks(plan, stream)


@mutant("copy.error")
class SwallowsFailures(CPUPlugin):
    """Catches a failing copy's exception on the stream and drops it: its event completes normally."""

    @hookimpl
    def kvhal_copy_blocks(self, plan: CopyPlan, stream: Stream) -> CPUEvent:
        work = _copy(self.engine, plan)

        def guarded() -> None:
            with contextlib.suppress(Exception):
                work()

        return _record_after(stream, guarded)


class _StickyStream(CPUStream):
    """Never clears a failure: every later event on the stream reports it."""

    def record(self, event: CPUEvent) -> None:
        marker = _Marker()
        event._marker = marker
        state: _State = self._state

        def reach() -> None:
            marker.error = state.pending_error
            marker.done.set()

        self.submit(reach)


@mutant("copy.error")
class StickyFailure(CPUPlugin):
    """A copy stream that failed once reports the failure from every later event on it."""

    @hookimpl
    def kvhal_create_stream(self, device: torch.device) -> CPUStream:
        return _StickyStream()


@mutant("copy.async", also=("copy.error",), why="a copy run on the caller's thread raises its failure there")
class SyncCopy(CPUPlugin):
    """Declares copy.async but copies on the caller's thread: waits for the stream, copies, returns."""

    @hookimpl
    def kvhal_copy_blocks(self, plan: CopyPlan, stream: Stream) -> CPUEvent:
        stream.synchronize()  # stream order is kept; only the asynchrony is gone
        self.engine.run(*plan.descriptors)
        done = CPUEvent()
        stream.record(done)
        return done


#: The staging buffer of :class:`StagingOverflow`: more than every preset's large copy (at most
#: 4 MiB, in ``tiny``, the size mutants run at), less than the busy work's batch (8 MiB there).
STAGING = 6 << 20


@mutant("copy.data")
class StagingOverflow(CPUPlugin):
    """Copies through a staging area of 6 MiB: of a larger batch, only the descriptors that fit
    are copied, the rest is silently left out (the overflow check counts bytes once per batch)."""

    @hookimpl
    def kvhal_copy_blocks(self, plan: CopyPlan, stream: Stream) -> CPUEvent:
        engine = self.engine

        def staged() -> None:
            src, dst, sizes = plan.descriptors
            fits = np.cumsum(sizes) <= STAGING
            engine.run(src[fits], dst[fits], sizes[fits])

        return _record_after(stream, staged)


@mutant("copy.throughput", floor=0.25)
class SlowLargeCopies(CPUPlugin):
    """Copies of more than 8 MiB take a slow path (one descriptor at a time with a pause
    after each batch of work): about ten times slower than the device can."""

    @hookimpl
    def kvhal_copy_blocks(self, plan: CopyPlan, stream: Stream) -> CPUEvent:
        if plan.num_bytes <= LARGE:
            return super().kvhal_copy_blocks(plan, stream)
        engine = self.engine

        def slow() -> None:
            start = time.perf_counter()
            engine.run(*plan.descriptors)
            time.sleep(9 * (time.perf_counter() - start))

        return _record_after(stream, slow)
