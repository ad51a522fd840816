"""Mutants of streams and events: ordering, records, queries, waits."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

import torch

from kvhal.cpu import CPUPlugin
from kvhal.cpu.streams import CPUEvent, CPUStream, InlineStream, _Marker, _worker
from kvhal.errors import TransferError
from kvhal.hookspecs import hookimpl
from kvhal_conformance.mutants.registry import (
    Stream,
    mutant,
)


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
    also=("sync.error", "copy.data"),
    why="a synchronize that does not wait cannot report the copy's failure, and a check that "
    "reads a copy's blocks after it may find them unwritten (seen in CI on a loaded machine)",
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


@mutant("wait.binds")
class LazyWait(CPUPlugin):
    """kvhal_stream_wait_event looks the event's record up when the stream's worker reaches the
    wait, not when the wait is queued: an event recorded again meanwhile (say, on the waiting
    stream itself, behind the wait) is waited for instead, and the stream deadlocks."""

    @hookimpl
    def kvhal_stream_wait_event(self, stream: Stream, event: CPUEvent) -> None:
        if not isinstance(stream, CPUStream):
            stream.wait_event(event)
            return

        def wait_for_latest() -> None:
            marker = event._marker  # the record current now, at the worker, not at the call
            if marker is not None:
                marker.done.wait()

        stream.submit(wait_for_latest)
