"""Contract: streams and events (``kvhal_create_stream`` ... ``kvhal_stream_wait_event``),
and how ``kvhal_copy_blocks`` runs on the stream it is given.

Checks that need work still running first put a measured minimum of copies on
a stream (:class:`~kvhal_conformance.timing.Busy`). Verdicts rest on data, never
on how long something took: a copy's destination that changes while the work it
must follow is incomplete, an event that completes while bytes of its copy are
missing (and arrive later), a call that was to return at once returning only
after the copy it concerns had written everything. Ordering and events are
checked in both directions, on one stream and across two streams joined by a
wait, for one small block, one block of an odd size, and a batch of many MiB.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

from kvhal.descriptor import Capability
from kvhal.device import Device
from kvhal.errors import TransferError
from kvhal_conformance import blockdata, guarded
from kvhal_conformance.base.fixtures import ContractFixtures, final
from kvhal_conformance.clauses import DIRECTIONS, SIZES, covers, expect, violated
from kvhal_conformance.copycase import judge_query, synchronize_and_check
from kvhal_conformance.settings import Sizes
from kvhal_conformance.streamcase import (
    READ_TRIALS,
    TRIALS,
    Rig,
    RigFixture,
    early_record_clause,
    failing_plan,
    judge_overtaken,
    judge_read_after_write,
    reader_of,
)
from kvhal_conformance.streamrig import Chain, free_chain, make_chain
from kvhal_conformance.target import Target
from kvhal_conformance.timing import Busy, poll, wait

#: How long an event recorded on an idle stream may take to report complete.
IDLE_LIMIT_S = 5.0
#: Least time a copy queued behind a wait may take before the wait counts as deadlocked.
WAIT_BINDS_LIMIT_S = 15.0


class StreamsEventsContract(RigFixture, ContractFixtures):
    """Contract ``streams_events``: the current stream is the compute stream; new streams and
    events are new; in both directions and at every size, on one stream and across a wait, a
    copy writes nothing before earlier work completes and its events complete only after its
    bytes are written; re-recorded events follow their new record; queries, stream waits and
    (with ``copy.async``) copies do not block; a failed copy surfaces as TransferError.

    Fixtures: ``kvhal_target``, ``kvhal_device``, ``kvhal_sizes`` (``busy_seconds``,
    ``large_copy_bytes``), ``kvhal_busy``, ``kvhal_seed``, ``kvhal_rng`` and
    ``kvhal_new_stream``: the streams every check submits its work to, except
    ``test_new_streams_are_new``, which checks ``kvhal_create_stream`` itself (see
    :class:`ContractFixtures`); ``rig`` (function) bundles them and makes the copies,
    ``chain`` (class) the two copies of the stream-order checks.
    """

    contract_id = "streams_events"

    @pytest.fixture(scope="class")
    @classmethod
    def chain(cls, kvhal_device: Device, kvhal_busy: Busy, kvhal_sizes: Sizes) -> Iterator[Chain]:
        made = make_chain(kvhal_device, kvhal_busy, kvhal_sizes.large_copy_bytes)
        yield made
        free_chain(made)

    # -- the compute stream, new streams, new events --------------------------------

    @final
    @covers("current.compute")
    def test_current_stream_is_the_compute_stream(self, kvhal_target: Target, kvhal_device: Device) -> None:
        """kvhal_current_stream returns the stream compute runs on: every copy is ordered after it.

        The same stream on every call; and, where torch drives streams for the
        device type, torch's own current stream.
        """
        first, second = kvhal_device.current_stream(), kvhal_device.current_stream()
        expect(
            first is second or first == second,
            "current.compute",
            f"plugin {kvhal_target.name!r}: kvhal_current_stream returned two different "
            "streams on two calls; it must return the stream the engine computes on, not a "
            "new one (copies are ordered after it)",
        )
        accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        if accelerator is not None and accelerator.type == kvhal_device.torch_device.type:
            torchs = torch.accelerator.current_stream(kvhal_device.torch_device)
            same = (getattr(first, "stream_id", None), getattr(first, "device_index", None)) == (
                torchs.stream_id,
                torchs.device_index,
            )
            expect(
                same,
                "current.compute",
                f"plugin {kvhal_target.name!r}: kvhal_current_stream returned {first!r}, not torch's current "
                f"stream {torchs!r}: copies would not be ordered after the engine's compute; it must return "
                "torch.accelerator.current_stream() for the device",
            )

    @final
    @covers("stream.new")
    def test_new_streams_are_new(self, kvhal_target: Target, kvhal_device: Device) -> None:
        """kvhal_create_stream returns a new stream on every call."""
        streams = [kvhal_device.create_stream() for _ in range(3)]
        for i in range(len(streams)):
            for j in range(i):
                expect(
                    streams[i] is not streams[j],
                    "stream.new",
                    f"plugin {kvhal_target.name!r}: kvhal_create_stream returned the same stream on "
                    f"calls {j + 1} and {i + 1}: every call must return a new stream (work on one "
                    "must not queue behind another's)",
                )

    @final
    @covers("event.new")
    def test_new_event_is_complete(self, rig: Rig) -> None:
        """A new, unrecorded event queries complete and synchronizes at once, also while another
        event is pending; every call returns a new event."""
        stream = rig.new_stream()
        pending, _ = rig.busy.occupy(stream, rig.sizes.busy_seconds)
        recorded = rig.device.create_event()
        rig.device.record_event(recorded, stream)
        event = rig.device.create_event()
        expect(
            event is not recorded,
            "event.new",
            "kvhal_create_event returned an event it had returned before (one now recorded on a busy "
            "stream): every call must return a new event",
        )
        expect(
            rig.device.query_event(event),
            "event.new",
            "kvhal_query_event: a new, unrecorded event must report complete (it reported incomplete while "
            "another event was pending on a busy stream)",
        )
        wait(rig.device, event, "a new, unrecorded event", limit_s=IDLE_LIMIT_S)
        wait(rig.device, recorded, "an event recorded after busy work")
        wait(rig.device, pending, "busy work")

    @final
    @covers("record.completes")
    def test_event_on_idle_stream_completes(self, rig: Rig) -> None:
        """An event recorded on a new stream, or on the compute stream, with no work completes."""
        for name, stream in (("a new stream", rig.new_stream()), ("the compute stream", None)):
            stream = rig.device.current_stream() if stream is None else stream
            event = rig.device.create_event()
            rig.device.record_event(event, stream)
            try:
                poll(rig.device, event, f"an event recorded on {name} with no work", limit_s=IDLE_LIMIT_S)
            except pytest.fail.Exception:
                violated(
                    "record.completes",
                    f"kvhal_query_event still reports an event recorded on {name} with no work incomplete "
                    f"after {IDLE_LIMIT_S:.0f} s: an event recorded on an idle stream must complete at once",
                )
            wait(rig.device, event, f"an event recorded on {name} with no work", limit_s=IDLE_LIMIT_S)

    # -- ordering and events, every direction and size -----------------------------

    @final
    @covers(
        "copy.ordering", "copy.event", "record.after_work", "copy.data", "copy.dst_only", "copy.src_unchanged"
    )
    @pytest.mark.parametrize("size", SIZES)
    @pytest.mark.parametrize("direction", DIRECTIONS)
    def test_copy_waits_for_earlier_work_on_its_stream(self, rig: Rig, direction: str, size: str) -> None:
        """A copy queued behind busy work on its stream writes nothing until that work completes;
        its event, and one recorded after it, complete only after its bytes are written; then
        exactly its destination blocks hold its source."""
        case = rig.case(direction, size)
        rig.ordered_copy(case, two_streams=False)

    @final
    @covers(
        "wait.orders", "copy.event", "record.after_work", "copy.data", "copy.dst_only", "copy.src_unchanged"
    )
    @pytest.mark.parametrize("size", SIZES)
    @pytest.mark.parametrize("direction", DIRECTIONS)
    def test_copy_waits_for_the_event_of_another_stream(self, rig: Rig, direction: str, size: str) -> None:
        """After kvhal_stream_wait_event(B, event of busy work on A), a copy on B writes nothing until
        that work completes; its events and data are right."""
        case = rig.case(direction, size)
        rig.ordered_copy(case, two_streams=True)

    @final
    @covers("copy.event", "query.state")
    @pytest.mark.parametrize("direction", DIRECTIONS)
    def test_event_not_complete_before_its_work(self, rig: Rig, direction: str) -> None:
        """A large copy's event queries incomplete while the copy runs and complete after it."""
        device, stream = rig.device, rig.new_stream()
        case, copied = rig.queue_large_copy(stream, direction)
        context = f"{case.what} behind busy work (its event, by kvhal_query_event)"
        poll(device, copied, context)
        missing = case.missing()
        if len(missing):
            judge_query(device, copied, case, missing, "copy.event", context, rig.busy)
        synchronize_and_check(device, copied, case, "copy.event", context)

    @final
    @covers("sync.waits", "copy.event")
    @pytest.mark.parametrize("direction", DIRECTIONS)
    def test_synchronize_waits_for_copy(self, rig: Rig, direction: str) -> None:
        """kvhal_synchronize_event returns only when every byte of a large copy is written."""
        device, stream = rig.device, rig.new_stream()
        case, copied = rig.queue_large_copy(stream, direction)
        synchronize_and_check(device, copied, case, "copy.event", f"{case.what} behind busy work (its event)")

    @final
    @covers("copy.on_stream", "record.after_work")
    @pytest.mark.parametrize("direction", DIRECTIONS)
    def test_event_recorded_after_copy_follows_it(self, rig: Rig, direction: str) -> None:
        """An event recorded on a stream after a large copy on it completes only after that copy."""
        device, stream = rig.device, rig.new_stream()
        case, copied = rig.queue_large_copy(stream, direction)
        after = device.create_event()
        device.record_event(after, stream)
        context = (
            f"an event recorded with kvhal_record_event on the stream after {case.what} behind busy work"
        )
        poll(device, after, context)
        missing = case.missing()
        if len(missing):  # complete while the copy before it is not
            judge_query(
                device, after, case, missing, early_record_clause(device, rig.busy), context, rig.busy
            )
        synchronize_and_check(device, copied, case, "copy.event", f"{case.what} behind busy work")

    # -- stream order across copies, and waits --------------------------------------

    @final
    @covers("stream.order")
    def test_stream_keeps_work_in_order(self, rig: Rig, chain: Chain) -> None:
        """Copies on one stream run in submission order: a later copy neither starts before
        earlier work completes nor misses what an earlier copy wrote."""
        chain.reset(rig.seed)
        stream = rig.new_stream()
        earlier = chain.occupy(stream, rig.sizes.busy_seconds)
        chain.submit(chain.first, stream)
        chain.expect_after(
            "stream.order",
            earlier,
            chain.submit(chain.second, stream),
            "kvhal_copy_blocks: a host->device copy then a device->host copy "
            "of the same blocks on one stream",
            started_early="a copy wrote its destination while copies submitted earlier to the same stream "
            "were still incomplete: work on one stream must run in submission order",
            read_early="the second read the device blocks before the first wrote them: work on one stream "
            "must run in order",
        )

    @final
    @covers("stream.order")
    def test_stream_runs_one_copy_at_a_time(self, rig: Rig) -> None:
        """Two large copies submitted to one idle stream run one after the other: the second writes
        nothing while the first is incomplete (in 3 trials; a stream served by several threads at
        once shows here)."""
        device = rig.device
        first, second = rig.case("h2d", "large"), rig.case("d2h", "large")
        for trial in range(TRIALS):
            if trial:
                first.rewind()
                second.rewind()
            stream = rig.new_stream()
            first_done = first.submit(stream)
            second_done = second.submit(stream)

            def one_at_a_time(first_done: object = first_done) -> None:
                # the second's destination first, the first's second: it was unwritten after that
                if second.dst_changed() and len(unwritten := first.unwritten()):
                    judge_overtaken(device, first, first_done, second, unwritten)

            poll(
                device,
                second_done,
                f"{second.what} after {first.what} on one stream",
                while_pending=one_at_a_time,
            )
            synchronize_and_check(
                device, first_done, first, "copy.event", f"{first.what} (first on its stream)"
            )
            synchronize_and_check(
                device, second_done, second, "copy.event", f"{second.what} (second on its stream)"
            )

    @final
    @covers("stream.order")
    def test_copy_reads_what_the_copy_before_it_wrote(self, rig: Rig) -> None:
        """A copy reading every block that a large copy submitted just before it to the same
        idle stream writes gets what the large copy wrote (in several trials, each judged on
        the data once written: a stream that runs work side by side fails a trial whenever its
        second thread takes the read before the write is done)."""
        device = rig.device
        large = rig.case("h2d", "large")
        reader, into = reader_of(device, large)
        try:
            for trial in range(READ_TRIALS):
                if trial:
                    large.rewind()
                into_before = blockdata.fill(into, rig.seed + 100 + trial)
                stream = rig.new_stream()
                written = large.submit(stream)
                read = device.submit(reader, stream, after_compute=False)
                wait(device, written, f"{large.what} (first on its stream)")
                wait(device, read, "a copy of every block it wrote (second on the stream)")
                judge_read_after_write(large, into, into_before)
        finally:
            guarded.free_cache(device, into)

    @final
    @covers("wait.orders")
    def test_stream_waits_for_event(self, rig: Rig, chain: Chain) -> None:
        """After kvhal_stream_wait_event(B, event of a copy on A), B's copies see what A's copy wrote."""
        device = chain.device
        chain.reset(rig.seed)
        a, b = rig.new_stream(), rig.new_stream()
        chain.occupy(a, rig.sizes.busy_seconds)
        written = chain.submit(chain.first, a)
        device.stream_wait_event(b, written)
        chain.expect_after(
            "wait.orders",
            written,
            chain.submit(chain.second, b),
            "kvhal_stream_wait_event: stream B waited for the event of a host->device copy on stream A, then "
            "copied those blocks device->host",
            started_early="B's copy wrote its destination before the event on A that B waits for completed: "
            "work submitted to B after kvhal_stream_wait_event must not start before the event completes",
            read_early="B's copy read the device blocks before A's copy wrote them: work submitted to B "
            "after kvhal_stream_wait_event must not start before the event completes",
            earlier_is_first=True,
        )

    @final
    @covers("wait.orders")
    def test_wait_for_unrecorded_event_holds_nothing_up(self, rig: Rig) -> None:
        """A stream made to wait for an event never recorded runs its next copy."""
        device, case = rig.device, rig.case("d2h", "small")
        stream = rig.new_stream()
        device.stream_wait_event(stream, device.create_event())
        synchronize_and_check(
            device,
            case.submit(stream),
            case,
            "copy.event",
            f"{case.what} after a wait for an event never recorded",
        )

    @final
    @covers("record.again")
    def test_event_recorded_again_follows_new_work(self, rig: Rig) -> None:
        """An event recorded a second time refers to its new record: queries, synchronizes and
        stream waits after it wait for the work before the new record; once complete it may be
        synchronized and queried again."""
        device = rig.device
        large, small = rig.case("d2h", "large"), rig.case("h2d", "small")
        event = device.create_event()
        device.record_event(event, rig.new_stream())  # a first record, on an idle stream
        wait(device, event, "an event recorded on an idle stream", limit_s=IDLE_LIMIT_S)
        stream = rig.new_stream()
        rig.busy.occupy(stream, rig.sizes.busy_seconds)
        copied = large.submit(stream)
        device.record_event(event, stream)  # recorded again: it now follows the large copy
        waiting = rig.new_stream()
        device.stream_wait_event(waiting, event)
        follower = small.submit(waiting)
        context = f"an event recorded a second time, after {large.what} behind busy work"

        def while_pending() -> None:
            if small.dst_changed() and not device.query_event(copied):
                violated(
                    "record.again",
                    f"{context}: a stream made to wait for it ran {small.what} while the large copy was "
                    "still unwritten: a wait refers to the event's last record",
                )

        poll(device, event, context, while_pending=while_pending)
        missing = large.missing()
        if len(missing):
            judge_query(device, event, large, missing, "record.again", context, rig.busy)
        synchronize_and_check(device, event, large, "record.again", context)
        wait(device, event, f"{context}: synchronized a second time")
        expect(
            device.query_event(event),
            "record.again",
            f"{context}: kvhal_query_event reports incomplete an event kvhal_synchronize_event returned "
            "for: a synchronized event must query complete until it is recorded again",
        )
        wait(device, copied, f"{large.what} (its event)")
        synchronize_and_check(device, follower, small, "copy.event", f"{small.what} on the waiting stream")

    @final
    @covers("wait.binds")
    def test_wait_binds_to_the_record_it_was_given(self, rig: Rig) -> None:
        """A wait is for the event's last record when kvhal_stream_wait_event is called: recorded
        again at once on the waiting stream itself, behind the wait, the event does not hold the
        wait up (a wait that looks the record up only when its stream reaches it waits for a
        record queued behind itself: a deadlock, reported as such after a deadline, never hung)."""
        device, case = rig.device, rig.case("h2d", "small")
        a, b = rig.new_stream(), rig.new_stream()
        event = device.create_event()
        _, busy_a = rig.busy.occupy(a, rig.sizes.busy_seconds)
        device.record_event(event, a)  # the record the wait is given
        _, busy_b = rig.busy.occupy(b, 5 * rig.sizes.busy_seconds)  # B reaches the wait later
        device.stream_wait_event(b, event)
        device.record_event(event, b)  # recorded again, behind the wait, before B reaches it
        copied = case.submit(b)
        after = device.create_event()
        device.record_event(after, b)
        limit_s = max(WAIT_BINDS_LIMIT_S, 20 * (busy_a + busy_b))
        context = (
            f"kvhal_stream_wait_event(stream B, event): the event was recorded on stream A behind "
            f"{busy_a * 1e3:.0f} ms of copies, B (behind {busy_b * 1e3:.0f} ms of copies) was made to "
            "wait for it, the event was recorded again on B behind the wait, then B got "
            f"{case.what}"
        )
        # Judged on the copy's bytes (events that complete early, another clause, must not pass
        # for progress); at the deadline, a copy whose events both completed is no hang.
        deadline = time.monotonic() + limit_s
        while len(case.missing()):
            if time.monotonic() > deadline:
                if device.query_event(copied) and device.query_event(after):
                    break  # the copy's data are wrong, judged below
                violated(
                    "wait.binds",
                    f"{context}: the copy had not run after {limit_s:.0f} s: B waits for the record queued "
                    "behind its own wait (a deadlock). A wait must bind to the event's last record at the "
                    "time kvhal_stream_wait_event is called (as cudaStreamWaitEvent does); a later record "
                    "must not change what it waits for",
                )
            time.sleep(0.001)
        synchronize_and_check(device, copied, case, "copy.event", f"{context} (its event)")
        wait(device, event, f"{context}: the event's second record")

    # -- what must not block --------------------------------------------------------

    @final
    @covers("query.nonblocking")
    def test_query_does_not_block(self, rig: Rig) -> None:
        """kvhal_query_event returns at once: querying the event of a copy queued behind busy work
        does not wait for the copy (judged on data, in 3 trials; a trial whose copy was done when
        kvhal_copy_blocks returned tells nothing and counts as not blocked)."""
        answers: list[bool] = []
        _, blocked, busy_s = rig.blocks(
            lambda _s, e: answers.append(rig.device.query_event(e)),
            judged="call",
        )
        expect(
            blocked < TRIALS,
            "query.nonblocking",
            "kvhal_query_event returned only after the copy whose event it was asked about had finished "
            f"({blocked} of {TRIALS} trials; the copy was queued behind at least {busy_s * 1e3:.0f} ms of "
            f"work, answers {answers}): a query must not wait for the work",
        )

    @final
    @covers("wait.nonblocking")
    def test_stream_wait_does_not_block(self, rig: Rig) -> None:
        """kvhal_stream_wait_event returns at once: making a stream wait for the event of a copy
        queued behind busy work does not wait for the copy (judged on data, in 3 trials, run again
        behind longer work when all 3 look blocked)."""
        waiting = iter([rig.new_stream() for _ in range(2 * TRIALS)])  # made before: not timed
        _, blocked, busy_s = rig.blocks(
            lambda _s, e: rig.device.stream_wait_event(next(waiting), e),
            judged="call",
        )
        expect(
            blocked < TRIALS,
            "wait.nonblocking",
            "kvhal_stream_wait_event returned only after the copy whose event it was given had finished "
            f"({blocked} of {TRIALS} trials; the copy was queued behind at least {busy_s * 1e3:.0f} ms of "
            "work): it must return without waiting for the event (without blocking the caller)",
        )

    @final
    @covers("copy.async")
    def test_copies_are_asynchronous(self, rig: Rig, kvhal_target: Target) -> None:
        """With copy.async declared, kvhal_copy_blocks returns before its copy has run.

        The copy is queued behind a measured minimum of busy work; the moment
        kvhal_copy_blocks returns, its sampled destination blocks are read. A synchronous
        plugin has written them all by then; an asynchronous one cannot have (its stream is
        still busy), unless the test thread stalled for the whole busy time: a violation only
        when it happens in every one of 3 trials.
        """
        kvhal_target.require(Capability.ASYNC_COPY)
        blocked, _, busy_s = rig.blocks(lambda _s, _e: None, judged="submit")
        expect(
            blocked < TRIALS,
            "copy.async",
            f"plugin {kvhal_target.name!r} declares {Capability.ASYNC_COPY.value}, but kvhal_copy_blocks "
            f"returned only after its copy had finished ({blocked} of {TRIALS} trials): the copy was queued "
            f"behind at least {busy_s * 1e3:.0f} ms of work on its stream, yet every sampled destination "
            "block held its data the moment the hook returned. kvhal_copy_blocks must enqueue the copy on "
            "the stream and return without waiting for it",
        )

    # -- failures -------------------------------------------------------------------

    @final
    @covers("copy.error", "query.error", "sync.error")
    def test_failed_copy_reports_transfer_error(self, rig: Rig, kvhal_target: Target) -> None:
        """A copy that fails (here: its plan cannot be read) returns an event anyway; querying and
        synchronizing that event raise TransferError; the next copy on the stream works."""
        device, case = rig.device, rig.case("h2d", "small")
        stream = rig.new_stream()
        copy_hook = kvhal_target.caller("kvhal_copy_blocks")
        outcomes = []
        for attempt in range(2):
            try:
                event = copy_hook(plan=failing_plan(case.plan), stream=stream)
            except Exception as exc:
                violated(
                    "copy.error",
                    f"kvhal_copy_blocks raised {type(exc).__name__}: {exc} for a copy that failed: a failure "
                    "must surface through the event it returns, as TransferError",
                )
            expect(
                event is not None,
                "copy.error",
                "kvhal_copy_blocks returned None for a copy that failed: it must return an event anyway, "
                "whose query and synchronize raise TransferError",
            )
            queried = synchronized = None
            if attempt == 0:  # the first failure is queried until it reports, then synchronized
                try:
                    poll(device, event, "the event of a failed copy", limit_s=30)
                    queried = False
                except TransferError:
                    queried = True
            try:
                wait(device, event, "the event of a failed copy", limit_s=30)
                synchronized = False
            except TransferError:
                synchronized = True
            outcomes.append((queried, synchronized))
        (q0, s0), (_, s1) = outcomes
        if not q0 and not s0 and not s1:
            violated(
                "copy.error",
                "a copy that failed (its plan could not be read) returned an event that completed normally: "
                "querying and synchronizing it must raise TransferError",
            )
        expect(
            q0,
            "query.error",
            "kvhal_query_event reported the event of a failed copy complete without raising TransferError "
            "(kvhal_synchronize_event did raise it): a query must raise TransferError when the copy the "
            "event follows failed",
        )
        expect(
            s0 and s1,
            "sync.error",
            "kvhal_synchronize_event returned normally for the event of a failed copy "
            "(kvhal_query_event did raise TransferError): synchronize must raise TransferError when the "
            "copy the event follows failed",
        )
        try:
            synchronize_and_check(
                device,
                case.submit(stream),
                case,
                "copy.event",
                f"{case.what} submitted after a failed copy on the same stream",
            )
        except TransferError as exc:
            violated(
                "copy.error",
                f"{case.what}, submitted after a failed copy on the same stream, reported "
                f"the earlier failure ({exc}): a failure belongs to the copy that failed; "
                "later copies must be unaffected",
            )
