"""Contract: streams and events (``kvhal_create_stream`` ... ``kvhal_stream_wait_event``),
and that ``kvhal_copy_blocks`` runs on the stream it is given.

Checks that need work still running first put a measured minimum of copies on
a stream (:class:`~kvhal_conformance.timing.Busy`). Verdicts rest on data
(:mod:`kvhal_conformance.streamrig`), never on how long something took.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvhal.descriptor import Capability
from kvhal.device import Device
from kvhal_conformance.settings import Sizes
from kvhal_conformance.streamrig import WRONG_STREAM, Rig, free_rig, make_rig
from kvhal_conformance.target import Target
from kvhal_conformance.timing import Busy, poll, wait

#: With copy.async, a copy found fully written the moment kvhal_copy_blocks returns in this
#: many trials out of this many is a violation (one stalled test thread is not).
ASYNC_TRIALS = 3


@pytest.fixture(scope="module")
def rig(kvhal_device: Device, kvhal_busy: Busy, kvhal_sizes: Sizes) -> Iterator[Rig]:
    made = make_rig(kvhal_device, kvhal_busy, kvhal_sizes.watched_bytes)
    yield made
    free_rig(made)


def test_current_stream_is_the_compute_stream(kvhal_target: Target, kvhal_device: Device) -> None:
    """kvhal_current_stream returns the stream compute runs on: every copy is ordered after it.

    The same stream on every call; and, where torch drives streams for the
    device type, torch's own current stream.
    """
    first, second = kvhal_device.current_stream(), kvhal_device.current_stream()
    assert first is second or first == second, (
        f"plugin {kvhal_target.name!r}: kvhal_current_stream returned two different streams on two calls; "
        "it must return the stream the engine computes on, not a new one (copies are ordered after it)"
    )
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if accelerator is not None and accelerator.type == kvhal_device.torch_device.type:
        torchs = torch.accelerator.current_stream(kvhal_device.torch_device)
        same = (getattr(first, "stream_id", None), getattr(first, "device_index", None)) == (
            torchs.stream_id,
            torchs.device_index,
        )
        assert same, (
            f"plugin {kvhal_target.name!r}: kvhal_current_stream returned {first!r}, not torch's current "
            f"stream {torchs!r}: copies would not be ordered after the engine's compute"
        )


def test_new_event_is_complete(kvhal_device: Device) -> None:
    """A new, unrecorded event queries complete and synchronizes at once."""
    event = kvhal_device.create_event()
    assert kvhal_device.query_event(event), "kvhal_query_event: a new, unrecorded event must report complete"
    wait(kvhal_device, event, "a new, unrecorded event", limit_s=10)


def test_event_on_idle_stream_completes(kvhal_device: Device) -> None:
    """An event recorded on a new stream, or on the compute stream, with no work completes."""
    for name, stream in (("a new stream", kvhal_device.create_stream()), ("the compute stream", None)):
        stream = kvhal_device.current_stream() if stream is None else stream
        event = kvhal_device.create_event()
        kvhal_device.record_event(event, stream)
        wait(kvhal_device, event, f"an event recorded on {name} with no work", limit_s=30)
        assert kvhal_device.query_event(event), (
            f"kvhal_query_event: a synchronized event on {name} reports incomplete"
        )


def test_event_not_complete_before_its_work(rig: Rig, kvhal_sizes: Sizes, kvhal_seed: int) -> None:
    """A copy's event is incomplete while the copy cannot have finished, and complete after it."""
    device = rig.device
    _, event = rig.watched_after_busy(kvhal_seed, kvhal_sizes.busy_seconds)
    if device.query_event(event):
        rig.expect_watched_written(
            "kvhal_query_event reported a copy's event complete right after submission"
        )
    poll(device, event, "a copy's event")
    rig.expect_watched_written("kvhal_query_event reported a copy's event complete")
    wait(device, event, "a copy's event")


def test_synchronize_waits_for_copy(rig: Rig, kvhal_sizes: Sizes, kvhal_seed: int) -> None:
    """kvhal_synchronize_event returns only when every byte of the copy is written."""
    device = rig.device
    _, event = rig.watched_after_busy(kvhal_seed, kvhal_sizes.busy_seconds)
    missing = wait(device, event, "a copy's event", then=rig.watched_missing)
    rig.expect_watched_written("kvhal_synchronize_event returned for a copy's event", missing=missing)


def test_event_recorded_after_copy_follows_it(rig: Rig, kvhal_sizes: Sizes, kvhal_seed: int) -> None:
    """An event recorded on a stream after a copy on it completes only after that copy."""
    device = rig.device
    stream, copied = rig.watched_after_busy(kvhal_seed, kvhal_sizes.busy_seconds)
    event = device.create_event()
    device.record_event(event, stream)
    poll(device, event, "an event recorded after a copy")
    rig.expect_watched_written(
        "an event recorded with kvhal_record_event on the copy's stream after the copy completed",
        WRONG_STREAM,
    )
    wait(device, copied, "a copy's event")


def test_stream_keeps_work_in_order(rig: Rig, kvhal_sizes: Sizes, kvhal_seed: int) -> None:
    """Copies on one stream run in submission order: a later copy neither starts before
    earlier work completes nor misses what an earlier copy wrote."""
    device = rig.device
    rig.reset(kvhal_seed)
    stream = device.create_stream()
    earlier = rig.occupy(stream, kvhal_sizes.busy_seconds)
    rig.submit(rig.chain_in, stream)
    rig.expect_chain_after(
        earlier,
        rig.submit(rig.chain_out, stream),
        "kvhal_copy_blocks: a host->device copy then a device->host copy of the same blocks on one stream",
        started_early="a copy wrote its destination while copies submitted earlier to the same stream were "
        "still incomplete: work on one stream must run in submission order",
        read_early="the second read the device blocks before the first wrote them: work on one stream must "
        "run in order",
    )


def test_stream_waits_for_event(rig: Rig, kvhal_sizes: Sizes, kvhal_seed: int) -> None:
    """After kvhal_stream_wait_event(B, event of a copy on A), B's copies see what A's copy wrote."""
    device = rig.device
    rig.reset(kvhal_seed)
    a, b = device.create_stream(), device.create_stream()
    rig.occupy(a, kvhal_sizes.busy_seconds)
    written = rig.submit(rig.chain_in, a)
    device.stream_wait_event(b, written)
    rig.expect_chain_after(
        written,
        rig.submit(rig.chain_out, b),
        "kvhal_stream_wait_event: stream B waited for the event of a host->device copy on stream A, then "
        "copied those blocks device->host",
        started_early="B's copy wrote its destination before the event on A that B waits for completed",
        read_early="B's copy read the device blocks before A's copy wrote them",
    )


def test_copies_are_asynchronous(kvhal_target: Target, rig: Rig, kvhal_sizes: Sizes, kvhal_seed: int) -> None:
    """With copy.async declared, kvhal_copy_blocks returns before its copy has run.

    The watched copy is queued behind a measured minimum of busy work; the moment
    kvhal_copy_blocks returns, its sampled destination blocks are read. A synchronous
    plugin has written them all by then; an asynchronous one cannot have (its stream is
    still busy), unless the test thread stalled for the whole busy time: a violation only
    when it happens in every one of ``ASYNC_TRIALS`` trials.
    """
    kvhal_target.require(Capability.ASYNC_COPY)
    device = rig.device
    written_on_return = 0
    for trial in range(ASYNC_TRIALS):
        _, event = rig.watched_after_busy(kvhal_seed + trial, kvhal_sizes.busy_seconds)
        missing = rig.watched_missing()  # at once: the copy was only just submitted
        wait(device, event, "a copy's event")
        rig.expect_watched_written("kvhal_synchronize_event returned for a copy's event")
        written_on_return += not len(missing)
    assert written_on_return < ASYNC_TRIALS, (
        f"plugin {kvhal_target.name!r} declares {Capability.ASYNC_COPY.value}, but kvhal_copy_blocks "
        f"returned only after its copy had finished ({written_on_return} of {ASYNC_TRIALS} trials): the "
        f"copy was queued behind at least {rig.busy_s * 1e3:.0f} ms of work on its stream, yet every "
        "sampled destination block held its data the moment the hook returned. kvhal_copy_blocks must "
        "enqueue the copy on the stream and return without waiting for it"
    )
