"""Copy events report failures as TransferError."""

from __future__ import annotations

import pytest

from kvhal.accel.events import CopyEvent
from kvhal.errors import TransferError
from kvhal.testing.accel import FakeStreamModule


def test_a_failed_submission_surfaces_from_query_and_synchronize():
    module = FakeStreamModule()
    event = CopyEvent(module.Event())
    event.record(module.Stream())
    event.fail(OSError("cuMemcpyBatchAsync returned 1"))
    with pytest.raises(TransferError, match="cuMemcpyBatchAsync returned 1"):
        event.query()
    with pytest.raises(TransferError):
        event.synchronize()


def test_an_asynchronous_device_error_becomes_a_transfer_error():
    module = FakeStreamModule()
    event = CopyEvent(module.Event())
    event.inner.fail_with = RuntimeError("CUDA error: an illegal memory access was encountered")
    with pytest.raises(TransferError, match="illegal memory access"):
        event.query()
    with pytest.raises(TransferError, match="illegal memory access"):
        event.synchronize()


def test_recording_again_follows_new_work_and_forgets_the_old_error():
    module = FakeStreamModule(hold_events=True)
    event = CopyEvent(module.Event())
    event.fail(ValueError("old"))
    event.record(module.Stream())
    assert event.query() is False
    module.complete_all()
    assert event.query() is True


def test_wait_on_makes_the_stream_wait_for_the_inner_event():
    module = FakeStreamModule()
    event, stream = CopyEvent(module.Event()), module.Stream()
    event.wait_on(stream)
    assert stream.waited == [event.inner]


def test_a_failure_is_reported_only_after_the_queued_work_finishes():
    """Part of a failed copy may already be queued: recomputing must not race its writes."""
    module = FakeStreamModule(hold_events=True)
    event = CopyEvent(module.Event())
    event.record(module.Stream())
    event.fail(OSError("chunk 2 of 3 refused"))
    assert event.query() is False  # not yet: earlier chunks may still be writing
    module.complete_all()
    with pytest.raises(TransferError, match="chunk 2 of 3 refused"):
        event.query()
