"""Contract: device faults, made inside the plugin's own engine (``kvhal_inject_device_fault``).

A plugin declaring ``test.faults`` arms each fault of :data:`kvhal.hookspecs.DEVICE_FAULTS` on
a new, idle stream when asked. The checks then see that the fault surfaces as the hooks
promise: a copy the device failed reports TransferError through its event within a deadline
and writes nothing outside its destination blocks; a stalled stream's copy reads "not done",
at once, until the stall ends and then completes with its bytes; an event the device failed
raises TransferError; each stream works again afterwards. Verdicts rest on data: a copy
whose event completed normally is a swallowed error when blocks are missing, and a fault
that never fired (``fault.inject``) when every block arrived. A plugin that cannot inject a
fault gets a "not tested" row in the report, never a silent pass.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

import pytest

from kvhal.descriptor import Capability
from kvhal.device import Device
from kvhal.errors import TransferError
from kvhal.hookspecs import DEVICE_FAULTS
from kvhal_conformance import blockdata
from kvhal_conformance.base.fixtures import ContractFixtures, final
from kvhal_conformance.clauses import DIRECTIONS, covers, depends_on, expect, violated
from kvhal_conformance.copycase import synchronize_and_check
from kvhal_conformance.copycheck import unmapped_problems
from kvhal_conformance.streamcase import Rig, RigFixture
from kvhal_conformance.target import Target

F = TypeVar("F", bound=Callable[..., Any])
HOOK = "kvhal_inject_device_fault"
#: A device fault must surface (the event raises, or completes) within this.
FAULT_DEADLINE_S = 30.0
#: How long an armed stall holds a stream back.
STALL_S = 0.5
#: A query about a stalled copy answers within this (the stall is several times longer).
QUERY_LIMIT_S = 0.1
#: ``target.metrics`` key of what was tested: ``{fault: "tested" | "not tested (why)"}``.
METRIC = "device_faults"
#: What a fault check's verdict rests on besides the fault: caches laid out as labelled, and
#: copies, events and streams that work without a fault (where another check found one of
#: these broken, a fault check reads "not judged", not a second blame for that defect).
DEPENDS = (
    "layouts.permutation",
    "alloc.as_asked",
    "alloc.layout",
    "alloc.cross_layer",
    "copy.data",
    "copy.dst_only",
    "copy.src_unchanged",
    "copy.event",
    "copy.on_stream",
    "copy.ordering",
    "stream.order",
    "record.after_work",
    "query.state",
    "sync.waits",
)


def _depends(*covered: str) -> Callable[[F], F]:
    """``depends_on`` :data:`DEPENDS`, in doubt on what the check covers and what it depends on."""
    return depends_on(*DEPENDS, judges=tuple(dict.fromkeys((*covered, *DEPENDS))))


def faults_summary(target: Target | None) -> str | None:
    """The report's row: ``device faults: copy_error tested, ...`` or ``... not tested (why)``."""
    found = target.metrics.get(METRIC) if target else None
    if not found:
        return None
    if "*" in found:
        return f"device faults: {found['*']}"
    rows = [f"{fault} {found[fault]}" for fault in DEVICE_FAULTS if fault in found]
    return "device faults: " + ", ".join(rows)


def arm(target: Target, fault: str, stream: Any, seconds: float = 0.0) -> None:
    """Arm ``fault`` on ``stream``; skip, with a "not tested" row, where the plugin cannot."""
    found = target.metrics.setdefault(METRIC, {})
    target.require_device()
    if not target.declares(Capability.FAULTS.value):
        found.clear()
        declared = Capability.FAULTS.value
        found["*"] = f"not tested (no fault hook: plugin {target.name!r} does not declare {declared})"
        pytest.skip(f"device faults: {found['*']}")
    args = f"{HOOK}(fault={fault!r}, stream=..., seconds={seconds})"
    try:
        armed = target.caller(HOOK)(fault=fault, stream=stream, seconds=seconds)
    except Exception as exc:
        violated("fault.inject", f"{args} raised {type(exc).__name__}: {exc}: it must return True or False")
    if armed is None:
        violated(
            "fault.inject",
            f"plugin {target.name!r} declares {Capability.FAULTS.value}, but {args} returned None (is {HOOK} "
            "implemented?): it must arm the fault and return True, or return False where it cannot",
        )
    if armed is False:
        found[fault] = f"not tested ({HOOK} returned False: the plugin cannot inject it)"
        pytest.skip(f"device fault {fault}: {found[fault]}")
    expect(armed is True, "fault.inject", f"{args} returned {armed!r:.60}; expected True or False")
    found[fault] = "tested"


def outcome(device: Device, event: Any, limit_s: float) -> tuple[str, str]:
    """Query ``event`` until it completes or raises, at most ``limit_s``: ``("raised", message)``,
    ``("completed", "")``, or ``("pending", "")`` past the limit (then do not synchronize it: that
    would hang)."""
    start = time.perf_counter()
    while True:
        try:
            if device.query_event(event):
                break
        except TransferError as exc:
            return "raised", str(exc)
        if time.perf_counter() - start > limit_s:
            return "pending", ""
        time.sleep(0.0005)
    return "completed", ""


def synchronized(device: Device, event: Any) -> tuple[str, str]:
    """``("raised", message)`` or ``("completed", "")`` from synchronizing an event that queried done."""
    try:
        device.synchronize_event(event)
    except TransferError as exc:
        return "raised", str(exc)
    return "completed", ""


class DeviceFaultsContract(RigFixture, ContractFixtures):
    """Contract ``device_faults``: with ``test.faults`` declared, each fault the plugin arms in its
    own engine (``kvhal_inject_device_fault``) surfaces through the hooks as they promise, and the
    stream works again afterwards. Without it every check skips and the report says "device
    faults: not tested (no fault hook)".

    Fixtures: ``kvhal_target``, ``kvhal_device``, ``kvhal_sizes``, ``kvhal_busy``,
    ``kvhal_seed``, ``kvhal_rng`` and ``kvhal_new_stream`` (see :class:`ContractFixtures`);
    ``rig`` (function) bundles them and makes the copies.
    """

    contract_id = "device_faults"

    @final
    @covers("fault.inject", "copy.error", "query.error", "sync.error", "copy.dst_only")
    @_depends("fault.inject", "copy.error", "query.error", "sync.error", "copy.dst_only")
    @pytest.mark.parametrize("direction", DIRECTIONS)
    def test_a_copy_the_device_fails_surfaces_through_its_event(
        self, rig: Rig, kvhal_target: Target, direction: str
    ) -> None:
        """A copy failed on the device (copy_error, after its plan was read) does not raise from
        kvhal_copy_blocks; querying and synchronizing its event raise TransferError within 30 s;
        no destination block outside the copy changes; the next copy on the stream works."""
        device, stream = rig.device, rig.new_stream()
        case = rig.case(direction, "large")
        arm(kvhal_target, "copy_error", stream)
        what = f"{case.what} that the device failed ({HOOK} copy_error)"
        try:
            event = case.submit(stream)
        except Exception as exc:
            violated(
                "copy.error",
                f"kvhal_copy_blocks raised {type(exc).__name__}: {exc} for {what}: a failure on the device "
                "must surface through the event it returns, as TransferError",
            )
        queried, message = outcome(device, event, FAULT_DEADLINE_S)
        expect(
            queried != "pending",
            "copy.error",
            f"the event of {what} neither completed nor raised TransferError within "
            f"{FAULT_DEADLINE_S:.0f} s: a failure on the device must surface through the copy's event",
        )
        synced, _ = synchronized(device, event)
        outside = unmapped_problems(case.plan.mapping, case.dst_before, blockdata.read(case.plan.dst))
        expect(
            not outside,
            "copy.dst_only",
            lambda: (
                f"{what}: " + "; ".join(outside) + ": a failed copy may leave its own destination blocks "
                "unfinished, but must not write any other block"
            ),
        )
        if queried == "completed" and synced == "completed":
            missing = [p for clause, p in case.problems() if clause == "copy.data"]
            if missing:
                violated(
                    "copy.error",
                    f"{what}: its event completed normally (query and synchronize raised nothing), yet the "
                    f"copy did not deliver its blocks ({'; '.join(missing)}): a copy that failed on the "
                    "device must raise TransferError from querying and synchronizing its event, or kvhal "
                    "serves those blocks as valid KV",
                )
            violated(
                "fault.inject",
                f"{HOOK}(fault='copy_error') returned True, yet {case.what} on that stream wrote every block "
                "and its event completed normally: an armed copy_error must fail the next copy on the stream",
            )
        expect(
            queried == "raised",
            "query.error",
            f"kvhal_query_event reported the event of {what} complete without raising TransferError "
            "(kvhal_synchronize_event raised it): a query must raise TransferError when the copy failed",
        )
        expect(
            synced == "raised",
            "sync.error",
            f"kvhal_synchronize_event returned normally for the event of {what} (kvhal_query_event raised "
            f"TransferError: {message}): synchronize must raise TransferError when the copy failed",
        )
        self._stream_works_after(rig, stream, direction, "a copy the device failed")

    @final
    @covers("fault.inject", "query.state", "query.nonblocking", "copy.event")
    @_depends("fault.inject", "query.state", "query.nonblocking", "copy.event")
    def test_a_stalled_stream_reads_not_done_until_its_copy_ran(self, rig: Rig, kvhal_target: Target) -> None:
        """A copy on a stream stalled for 0.5 s (stream_stall): its event reads not done, and the
        query answers within 0.1 s, while the stall lasts; once the stall is over the copy
        completes with every byte, and the stream works again."""
        device, stream = rig.device, rig.new_stream()
        case = rig.case("h2d", "small")
        arm(kvhal_target, "stream_stall", stream, seconds=STALL_S)
        armed_at = time.perf_counter()
        event = case.submit(stream)
        what = f"{case.what} on a stream stalled for {STALL_S} s ({HOOK} stream_stall)"
        asked = time.perf_counter()
        try:
            done = device.query_event(event)
        except TransferError as exc:
            violated("query.state", f"kvhal_query_event raised for {what}, which had not failed: {exc}")
        took, elapsed = time.perf_counter() - asked, time.perf_counter() - armed_at
        expect(
            took < QUERY_LIMIT_S or elapsed >= STALL_S,
            "query.nonblocking",
            f"kvhal_query_event took {took:.2f} s to answer about {what}: a query must return at once, "
            "without waiting for the work",
        )
        if done and elapsed < STALL_S:
            missing = case.missing()
            expect(
                len(missing),
                "fault.inject",
                f"{HOOK}(fault='stream_stall', seconds={STALL_S}) returned True, yet {case.what} submitted "
                f"to that stream had run {elapsed:.3f} s later: an armed stall must hold back the work "
                "after it",
            )
            violated(
                ("query.state", "copy.event"),
                f"kvhal_query_event reported the event of {what} complete {elapsed:.3f} s after the stall "
                f"began, while dst blocks {blockdata.id_list(missing)} were unwritten: an event completes "
                "only once its copy has written every byte",
            )
        queried, message = outcome(device, event, STALL_S + FAULT_DEADLINE_S)
        expect(
            queried == "completed",
            "query.state",
            f"the event of {what} did not complete within {FAULT_DEADLINE_S:.0f} s after the stall "
            f"({queried}{': ' + message if message else ''}): a stall that ends is no failure",
        )
        ran_after = time.perf_counter() - armed_at
        missing = case.missing()
        expect(
            not len(missing),
            ("query.state", "copy.event"),
            f"kvhal_query_event reported the event of {what} complete while dst blocks "
            f"{blockdata.id_list(missing)} were unwritten: an event completes only once its copy has "
            "written every byte",
        )
        case.expect_done(f"after the stall, {what}")
        expect(
            ran_after >= STALL_S * 0.9,
            "fault.inject",
            f"{HOOK}(fault='stream_stall', seconds={STALL_S}) returned True, yet {case.what} submitted to "
            f"that stream had completed {ran_after:.3f} s later: an armed stall must hold back the work "
            "after it",
        )
        self._stream_works_after(rig, stream, "h2d", "a stall")

    @final
    @covers("fault.inject", "query.error", "sync.error", "copy.error")
    @_depends("fault.inject", "query.error", "sync.error", "copy.error")
    def test_an_event_the_device_fails_raises_transfer_error(self, rig: Rig, kvhal_target: Target) -> None:
        """An event recorded on a stream whose device work failed (event_error) raises TransferError
        from query and synchronize within 30 s; a copy on the stream afterwards works."""
        device, stream = rig.device, rig.new_stream()
        arm(kvhal_target, "event_error", stream)
        event = device.create_event()
        device.record_event(event, stream)
        what = f"an event recorded on a stream whose device work failed ({HOOK} event_error)"
        queried, message = outcome(device, event, FAULT_DEADLINE_S)
        expect(
            queried != "pending",
            "query.error",
            f"{what} neither completed nor raised TransferError within {FAULT_DEADLINE_S:.0f} s",
        )
        synced, _ = synchronized(device, event)
        expect(
            queried == "raised" or synced == "raised",
            "fault.inject",
            f"{HOOK}(fault='event_error') returned True, yet the next event recorded on that stream "
            "completed normally (query and synchronize raised nothing): either the fault was not armed, or "
            "the plugin's query and synchronize swallow device errors; an armed event_error must fail the "
            "next event",
        )
        expect(
            queried == "raised",
            "query.error",
            f"kvhal_query_event reported {what} complete without raising TransferError "
            "(kvhal_synchronize_event raised it): a query must raise TransferError when the device failed "
            "the work",
        )
        expect(
            synced == "raised",
            "sync.error",
            f"kvhal_synchronize_event returned normally for {what} (kvhal_query_event raised TransferError: "
            f"{message}): synchronize must raise TransferError when the device failed the work",
        )
        self._stream_works_after(rig, stream, "d2h", "an event the device failed")

    def _stream_works_after(self, rig: Rig, stream: Any, direction: str, fault: str) -> None:
        """A new copy on the same stream: it must complete, exactly right."""
        case = rig.case(direction, "small")
        context = f"{case.what}, submitted after {fault} on the same stream"
        try:
            synchronize_and_check(case.device, case.submit(stream), case, "copy.error", context)
        except TransferError as exc:
            violated(
                "copy.error",
                f"{context}, reported a failure ({exc}): a fault belongs to the work it hit; later work on "
                "the stream must be unaffected",
            )
