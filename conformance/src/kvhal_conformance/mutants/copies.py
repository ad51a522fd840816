"""Mutants of block copies: bounds, sources, streams, events, failures."""

from __future__ import annotations

import contextlib
import ctypes
import time

import numpy as np
import torch

from kvhal.copyplan import CopyPlan
from kvhal.cpu import CPUPlugin
from kvhal.cpu.streams import CPUEvent, CPUStream, _Marker, _State
from kvhal.hookspecs import hookimpl
from kvhal_conformance.mutants.registry import (
    LARGE,
    SMALL,
    Stream,
    _copy,
    _record_after,
    _storage_end,
    mutant,
)


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


#: The batch size above which :class:`DropsLastDescriptor` loses a descriptor.
BATCH_LIMIT = 32


@mutant("copy.data")
class DropsLastDescriptor(CPUPlugin):
    """Submits batches of more than 32 descriptors in chunks of 32 and loses the last
    descriptor (an off-by-one in the chunk loop's end): a large batch never delivers one block,
    and everything queued after it runs as usual."""

    @hookimpl
    def kvhal_copy_blocks(self, plan: CopyPlan, stream: Stream) -> CPUEvent:
        engine = self.engine

        def copy() -> None:
            src, dst, sizes = plan.descriptors
            if len(sizes) > BATCH_LIMIT:
                src, dst, sizes = src[:-1], dst[:-1], sizes[:-1]
            engine.run(src, dst, sizes)

        return _record_after(stream, copy)


@mutant(
    "copy.event",
    also=("sync.waits", "query.state", "wait.orders"),
    why="synchronize, query and a stream waiting for it see the event the copy returned, which "
    "completes before its bytes (whether the waiting stream's copy runs early enough to show it "
    "depends on the race)",
    not_judged=("copy.throughput",),
)
class EventsDoneAtDequeue(CPUPlugin):
    """Marks a copy's event done when the stream's worker takes the copy from the queue, before
    running it (a completion written at dispatch, not at the end of the work). Throughput timed
    by that event measures dispatch, not the copy."""

    @hookimpl
    def kvhal_copy_blocks(self, plan: CopyPlan, stream: Stream) -> CPUEvent:
        engine, done, marker = self.engine, CPUEvent(), _Marker()
        done._marker = marker

        def copy() -> None:
            try:
                descriptors = plan.descriptors
            except BaseException as exc:  # a failure to read the plan still reaches the event
                marker.error = exc
                marker.done.set()
                return
            marker.done.set()  # dequeued: "done"
            engine.run(*descriptors)

        stream.submit(copy)
        return done


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


@mutant("copy.error")
class SwallowsDeviceErrors(CPUPlugin):
    """Catches an error the device raises during a copy (after the plan was read and the copy
    accepted) and lets the copy's event complete normally: a failed DMA reads as a finished
    copy, and its half-written blocks as valid KV."""

    @hookimpl
    def kvhal_copy_blocks(self, plan: CopyPlan, stream: Stream) -> CPUEvent:
        engine = self.engine

        def copy() -> None:
            src, dst, sizes = plan.descriptors
            with contextlib.suppress(OSError):
                engine.run(src, dst, sizes)

        return _record_after(stream, copy)
