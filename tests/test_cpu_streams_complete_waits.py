"""CPU streams: a wait on an event already complete queues nothing (no task, no wake-up of the
stream's thread), as every copy's wait on the compute stream's marker; a wait on one not yet
complete still holds back the work behind it."""

from __future__ import annotations

import threading

from kvhal.cpu.streams import CPUEvent, CPUStream, InlineStream


def test_wait_on_a_complete_event_queues_nothing() -> None:
    stream, compute, event = CPUStream(), InlineStream(), CPUEvent()
    compute.record(event)
    assert event.query()
    stream.wait_event(event)
    assert stream._state.tasks.empty()
    stream.synchronize()


def test_wait_on_a_pending_event_holds_the_stream_back() -> None:
    blocker, waiter, event = CPUStream(), CPUStream(), CPUEvent()
    gate, ran = threading.Event(), threading.Event()
    blocker.submit(gate.wait)
    blocker.record(event)
    waiter.wait_event(event)
    waiter.submit(ran.set)
    assert not ran.wait(0.2)
    gate.set()
    assert ran.wait(5)


def test_compute_records_complete_at_once_and_never_fail() -> None:
    first, second = CPUEvent(), CPUEvent()
    InlineStream().record(first)
    InlineStream().record(second)
    assert first.query() and second.query()
    first.synchronize()
    second.synchronize()
