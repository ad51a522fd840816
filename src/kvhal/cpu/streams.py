"""Streams and events for the CPU, with the semantics of CUDA's.

A :class:`CPUStream` is a FIFO run by one daemon thread: work submitted to it
runs in order, off the caller's thread. An event records a marker into a
stream and completes when the worker reaches it; a task that raised makes the
next marker carry the error, so the event of a failed copy reports it. The
engine's compute runs on the calling thread, so the "current" stream is an
:class:`InlineStream`: its work is already done when submitted, and waiting
on an event there blocks the caller, as the compute stream would.
"""

from __future__ import annotations

import errno
import queue
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

from kvhal.errors import TransferError
from kvhal.threads import name_this_thread

Task = Callable[[], None]
_STOP = object()


@dataclass(eq=False)
class _Marker:
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


#: The compute stream's markers: its work is done when recorded.
_DONE = _Marker()
_DONE.done.set()


class CPUEvent:
    """An event: completes when the stream it was last recorded on reaches it."""

    def __init__(self) -> None:
        self._marker: _Marker | None = None

    def query(self) -> bool:
        marker = self._marker
        if marker is None:
            return True
        if not marker.done.is_set():
            return False
        self._raise(marker)
        return True

    def synchronize(self) -> None:
        marker = self._marker
        if marker is None:
            return
        marker.done.wait()
        self._raise(marker)

    @staticmethod
    def _raise(marker: _Marker) -> None:
        if marker.error is not None:
            raise TransferError(
                f"CPU copy failed: {type(marker.error).__name__}: {marker.error}"
            ) from marker.error


@dataclass(eq=False)
class _State:
    """What the worker thread shares with its stream (never the stream itself,
    so an unused stream is collected and its thread stops)."""

    tasks: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    pending_error: BaseException | None = None


def _worker(state: _State) -> None:
    name_this_thread()
    while True:
        task = state.tasks.get()
        if task is _STOP:
            return
        try:
            task()
        except BaseException as exc:  # reported through the next event
            state.pending_error = exc


class CPUStream:
    """Ordered asynchronous work on a daemon thread."""

    def __init__(self, name: str = "kvhal-cpu-stream") -> None:
        self._state = _State()
        self._thread = threading.Thread(target=_worker, args=(self._state,), name=name, daemon=True)
        self._thread.start()
        weakref.finalize(self, self._state.tasks.put, _STOP)

    def submit(self, task: Task) -> None:
        self._state.tasks.put(task)

    def stall(self, seconds: float) -> None:
        """Hold back work submitted after this for ``seconds``, as a hung engine would."""
        self.submit(lambda: time.sleep(seconds))

    def fail_next_event(self) -> None:
        """Make the next event recorded here report a device error: a task that fails, as
        device work that faulted would, whose error the next record carries."""

        def fault() -> None:
            raise OSError(errno.EIO, "injected device fault: the event failed (event_error)")

        self.submit(fault)

    def record(self, event: CPUEvent) -> None:
        marker = _Marker()
        event._marker = marker
        state = self._state

        def reach() -> None:
            marker.error, state.pending_error = state.pending_error, None
            marker.done.set()

        self.submit(reach)

    def wait_event(self, event: CPUEvent) -> None:
        marker = event._marker
        # an event already complete orders nothing (CUDA's wait captures the event as it is
        # now): no task to queue and no worker to wake, as for every copy's wait on the compute
        # stream's marker, recorded complete
        if marker is not None and not marker.done.is_set():
            self.submit(marker.done.wait)

    def synchronize(self) -> None:
        event = CPUEvent()
        self.record(event)
        event.synchronize()


class InlineStream:
    """The compute "stream": work runs on the caller's thread as it is submitted."""

    def submit(self, task: Task) -> None:
        task()

    def record(self, event: CPUEvent) -> None:
        event._marker = _DONE  # complete at once, never failed: one marker for every record

    def wait_event(self, event: CPUEvent) -> None:
        marker = event._marker
        if marker is not None:
            marker.done.wait()

    def synchronize(self) -> None:
        return None
