"""What the streams-and-events contract works with: copies on streams behind busy work
(:class:`Rig`), whose fault an early record is, and caches and plans whose copy fails."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import numpy as np
import pytest

from kvhal.cache import KVCache
from kvhal.copyplan import CopyPlan
from kvhal.device import Device
from kvhal_conformance import blockdata, guarded
from kvhal_conformance.blockdata import id_list
from kvhal_conformance.clauses import violated
from kvhal_conformance.copycase import BULK, CONTROL_BUSY_S, CopyCase, judge_query, synchronize_and_check
from kvhal_conformance.settings import Sizes
from kvhal_conformance.timing import Busy, poll, wait

#: A call that must not block is blocking when, in this many trials out of this many, the
#: copy it concerns had written everything by the time it returned (one stalled test thread
#: is not a violation).
TRIALS = 3

NewStream = Callable[[], Any]


def early_record_clause(device: Device, busy: Busy) -> str:
    """An event recorded after a copy completed before it: whose fault? A control event is
    recorded on a stream behind two waits: one for busy work running now, and one, still
    queued behind it, for busy work that follows. If the control completes while the
    second busy work is incomplete, the records are wrong (``record.after_work``: say, they
    follow only the work running when recorded, not work still queued); else the copy was
    not on the stream it was given (``copy.on_stream``)."""
    first, _ = busy.occupy(device.create_stream(), CONTROL_BUSY_S)
    follows = device.create_stream()
    device.stream_wait_event(follows, first)
    second, _ = busy.occupy(follows, 5 * CONTROL_BUSY_S)  # a wide window to see the control in
    stream = device.create_stream()
    device.stream_wait_event(stream, first)
    device.stream_wait_event(stream, second)
    control = device.create_event()
    device.record_event(control, stream)
    early = False

    def watch() -> None:
        nonlocal early  # the control first, the work second: it was incomplete when seen
        early = early or (device.query_event(control) and not device.query_event(second))

    poll(device, second, "busy work", while_pending=watch)
    return "record.after_work" if early else "copy.on_stream"


#: How long a first copy's event may take to complete once a second copy was seen writing.
OVERTAKEN_WAIT_S = 30.0


def judge_overtaken(
    device: Device, first: CopyCase, first_done: Any, second: CopyCase, unwritten: np.ndarray
) -> NoReturn:
    """``second``, submitted after ``first`` to one stream, was seen writing while sampled blocks
    ``unwritten`` of ``first`` still held their old contents. Overtaken (``stream.order``) if
    those blocks arrive later; never delivered (``copy.data``: the first copy is wrong, not the
    stream's order) if, once the first copy's event completed, they still do not hold their
    source."""
    with contextlib.suppress(Exception, pytest.fail.Exception):  # its event's faults are judged apart
        wait(device, first_done, f"{first.what} (first on its stream)", limit_s=OVERTAKEN_WAIT_S)
    first.arrives()  # bytes still landing, within a bound
    never = np.intersect1d(unwritten, first.missing())
    late = np.setdiff1d(unwritten, never)
    order = (
        f"kvhal_copy_blocks: {second.what} wrote its destination while {first.what}, submitted before it "
        f"to the same stream, was still writing (dst blocks {id_list(late)} of the first were written "
        "only later): work on one stream must run in submission order, one piece after the other"
    )
    if len(late) and len(never):
        violated(
            ("stream.order", "copy.data"),
            f"{order}; and dst blocks {id_list(never)} of the first were never written: every "
            "destination block of a plan must receive its source block",
        )
    if len(late):
        violated("stream.order", order)
    first.never_delivered(
        f"kvhal_copy_blocks, the first of two copies on one stream (sampled dst blocks {id_list(never)} "
        "still unwritten after its event completed; the second ran after it)"
    )


#: Trials of a read submitted right behind a write on one idle stream: cheap, and a stream that
#: runs work side by side shows in a trial only if its second thread takes the read before the
#: write is done.
READ_TRIALS = 5
#: How long read blocks must stay unchanged once every layer was written (late bytes of a stream
#: whose events complete early land within it).
STILL_S = 0.1
#: The most that is waited for that.
STILL_LIMIT_S = 5.0


def reader_of(device: Device, written: CopyCase) -> tuple[CopyPlan, KVCache]:
    """A copy of every block of ``written``'s destination into the same blocks of a new host
    cache: one large read, so no fast path for small copies applies. The plan and the cache
    (the caller frees it)."""
    dst = written.plan.dst
    into = guarded.host_cache(device, dst.geometry, dst.layout, dst.geometry.num_blocks)
    ids = np.arange(dst.geometry.num_blocks)
    return device.plan_copy(dst, into, np.stack([ids, ids], axis=1)), into


def settled_blocks(cache: KVCache, ids: np.ndarray, before: blockdata.Snapshot) -> blockdata.Snapshot:
    """Blocks ``ids`` of ``cache`` once no layer of any holds ``before`` any more and they
    stopped changing (bounded: what they hold after STILL_LIMIT_S otherwise)."""
    deadline = time.perf_counter() + STILL_LIMIT_S
    seen = blockdata.read(cache, ids)
    while time.perf_counter() < deadline:
        time.sleep(STILL_S)
        again = blockdata.read(cache, ids)
        written = not bool(blockdata.some_layer_equal(again, before).any())
        if written and bool(blockdata.blocks_equal(again, seen).all()):
            return again
        seen = again
    return seen


def judge_read_after_write(large: CopyCase, into: KVCache, into_before: blockdata.Snapshot) -> None:
    """A copy that read every block of ``large``'s destination into the same blocks of ``into``,
    submitted after ``large`` to one stream, must have read what ``large`` wrote (judged on
    ``large``'s sampled blocks). Having read what a block held before ``large`` delivered it
    means it ran first (``stream.order``); a block ``large`` never delivered is the copy's fault,
    as is one the read never wrote (``copy.data``)."""
    ids = large.rows[:, 1]
    before = blockdata.take(into_before, ids)
    got = settled_blocks(into, ids, before)
    ok = blockdata.blocks_equal(got, blockdata.take(large.src_before, large.rows[:, 0])).numpy()
    if ok.all():
        return
    large.arrives()  # late bytes of a stream whose events complete early land first
    never = np.isin(ids, large.missing())
    unread = blockdata.some_layer_equal(got, before).numpy() & ~ok
    # every layer old, or some (a block read while the first copy was writing it)
    early = blockdata.some_layer_equal(got, blockdata.take(large.dst_before, ids)).numpy() & ~ok & ~never
    what = f"kvhal_copy_blocks: {large.what}, then a d2h copy of every block it wrote, on one idle stream"
    if early.any():
        violated(
            "stream.order",
            f"{what}: the second read device blocks {id_list(ids[early])} before the first wrote them "
            "(it got what they held before, in all or some layers): work on one stream must run in "
            "submission order, one piece after the other",
        )
    if never.any():
        large.never_delivered(f"{what} (sampled dst blocks {id_list(ids[never])} never written)")
    if unread.any():
        violated(
            "copy.data",
            f"{what}: host blocks {id_list(ids[unread])} of the second still held, in some layers, what "
            f"they held before it, {STILL_LIMIT_S:.0f} s after its event completed: every destination "
            "block of a plan must receive its source block",
        )
    violated(
        "copy.data",
        f"{what}: host blocks {id_list(ids[~ok])} held neither what the first copy wrote nor what the "
        "device blocks held before: every destination block of a plan must receive its source block",
    )


@dataclasses.dataclass
class Rig:
    """What the checks of streams and events work with: the device, busy work, the sizes, the
    stream factory, and the copies they make (:meth:`case`; freed by :meth:`free`)."""

    device: Device
    busy: Busy
    sizes: Sizes
    new_stream: NewStream
    seed: int
    rng: np.random.Generator
    made: list[CopyCase] = dataclasses.field(default_factory=list)

    def case(self, direction: str, size: str) -> CopyCase:
        """A copy of ``direction`` and ``size`` in the busy copies' layout."""
        case = CopyCase.make(
            self.device,
            self.busy.src.layout,
            direction,
            size,
            self.sizes,
            self.seed + len(self.made),
            self.rng,
        )
        self.made.append(case)
        return case

    def free(self) -> None:
        for case in self.made:
            case.free()

    def queue_large_copy(self, stream: Any, direction: str) -> tuple[CopyCase, Any]:
        """A large copy submitted to ``stream`` behind busy work: the case and the copy's event."""
        case = self.case(direction, "large")
        self.busy.occupy(stream, self.sizes.busy_seconds)
        return case, case.submit(stream)

    def ordered_copy(self, case: CopyCase, two_streams: bool) -> None:
        """Submit ``case`` behind busy work (on its stream, or on a second stream made to wait for
        the busy work's event) plus an event recorded after it; watch all three while the busy
        work runs, then check the copy."""
        device, busy = self.device, self.busy
        a = self.new_stream()
        earlier, busy_s = busy.occupy(a, self.sizes.busy_seconds)
        if two_streams:
            target = self.new_stream()
            device.stream_wait_event(target, earlier)
            order_clause, where = (
                "wait.orders",
                "on stream B, made to wait for the event of busy work on stream A",
            )
        else:
            target, order_clause, where = a, "copy.ordering", "on a stream behind busy work"
        copied = case.submit(target)
        after = device.create_event()
        device.record_event(after, target)
        context = f"{case.what} {where}"

        def while_earlier_pending() -> None:
            # Each verdict reads first and asks about the earlier work second: the earlier work
            # was still incomplete when the destination (or the event) was seen.
            if case.dst_changed() and not device.query_event(earlier):
                violated(
                    order_clause,
                    f"{context}: the copy wrote its destination while the work it must follow "
                    f"({busy_s * 1e3:.0f} ms of copies) was still incomplete: a copy must not start before "
                    "the work it follows has completed",
                )
            for event, name in ((copied, "its event"), (after, "an event recorded after it")):
                if device.query_event(event) and not device.query_event(earlier):
                    missing = case.missing()
                    if len(missing):
                        clause = "copy.event" if event is copied else early_record_clause(device, busy)
                        judge_query(
                            device,
                            event,
                            case,
                            missing,
                            clause,
                            f"{context} ({name}, complete before the busy work)",
                            busy,
                        )

        poll(device, earlier, "the busy work a copy must follow", while_pending=while_earlier_pending)
        poll(device, copied, context)
        missing = case.missing()
        if len(missing):
            judge_query(device, copied, case, missing, "copy.event", f"{context} (its event)", busy)
        synchronize_and_check(device, copied, case, "copy.event", context)
        wait(device, after, f"{context} (an event recorded after it)")

    def blocks(self, call: Callable[[Any, Any], None], *, judged: str) -> tuple[int, int, float]:
        """In :data:`TRIALS` trials, queue a bulk copy behind busy work, ``call(stream, event)``,
        and see whether the copy had written all it was sampled for when kvhal_copy_blocks
        returned, and when ``call`` returned: (trials in which it had by the first, trials in
        which it had not by the first but had by the second, the busy work's length).

        ``judged`` names the count a check judges (``"submit"`` or ``"call"``). When it is
        :data:`TRIALS`, the trials run once more behind four times the busy work: a test thread
        stalled for the whole busy work in every trial (a loaded machine) then rarely is again,
        while a plugin that blocks blocks however long the work is."""
        if judged not in ("submit", "call"):
            raise ValueError(f"judged must be 'submit' or 'call', not {judged!r}")
        # Few descriptors (see BULK): many would fill the device's queue, and then even an
        # asynchronous plugin's call waits for the work ahead. Submitting may still take a
        # while: the work queued ahead must outlast it, or the copy runs (and is seen done)
        # before the call returns. An idle submission measures it.
        case = self.case("d2h", BULK)
        stream = self.new_stream()
        start = time.perf_counter()
        idle = case.submit(stream)
        submit_s = time.perf_counter() - start
        # only timed: queried until done, not judged (a plugin whose waits return early would
        # otherwise be blamed here for the copies earlier checks left running)
        poll(self.device, idle, f"{case.what} on an idle stream")
        seconds = max(self.sizes.busy_seconds, 3 * submit_s)
        for _round in range(2):
            done_at_submit = done_by_call = 0
            busy_s = 0.0
            for _ in range(TRIALS):
                case.rewind()
                stream = self.new_stream()
                _, busy_s = self.busy.occupy(stream, seconds)
                copied = case.submit(stream)
                before = len(case.missing())  # at once: the copy is still queued behind the busy work
                call(stream, copied)
                after = len(case.missing())
                done_at_submit += not before
                done_by_call += bool(before) and not after
                synchronize_and_check(self.device, copied, case, "copy.event", case.what)
            if (done_at_submit if judged == "submit" else done_by_call) < TRIALS:
                break
            seconds *= 4
        return done_at_submit, done_by_call, busy_s


class RigFixture:
    """The ``rig`` fixture (function scope) of the contracts that copy on streams: a :class:`Rig`
    from the contract's fixtures, its copies freed after the test."""

    @pytest.fixture
    def rig(
        self,
        kvhal_device: Device,
        kvhal_busy: Busy,
        kvhal_sizes: Sizes,
        kvhal_new_stream: NewStream,
        kvhal_seed: int,
        kvhal_rng: np.random.Generator,
    ) -> Iterator[Rig]:
        made = Rig(kvhal_device, kvhal_busy, kvhal_sizes, kvhal_new_stream, kvhal_seed, kvhal_rng)
        yield made
        made.free()


class InjectedCopyFailure(RuntimeError):
    """What a plan handed to kvhal_copy_blocks by the failure check raises when read."""


def _injected() -> InjectedCopyFailure:
    return InjectedCopyFailure(
        "this copy's memory cannot be located (a failure injected by the conformance suite)"
    )


@dataclasses.dataclass(frozen=True, eq=False)
class FailingCache(KVCache):
    """A cache whose memory cannot be located: its views and buffers raise when read. Its
    geometry, layout, device and block count read as usual."""

    def __getattribute__(self, name: str) -> Any:
        if name in ("layers", "storage"):
            raise _injected()
        if name == "device":
            return object.__getattribute__(self, "_device")
        return object.__getattribute__(self, name)


def failing_cache(cache: KVCache) -> FailingCache:
    failing = object.__new__(FailingCache)  # no __post_init__: it would read the views
    for f in dataclasses.fields(KVCache):
        object.__setattr__(failing, f.name, object.__getattribute__(cache, f.name))
    object.__setattr__(failing, "_device", cache.device)
    return failing


@dataclasses.dataclass(frozen=True, eq=False)
class FailingPlan(CopyPlan):
    """A plan whose bytes cannot be located, whatever a plugin builds its copy from: its runs,
    segment families and descriptors raise when read, and so do its caches' views and buffers.
    Any copy of it fails before a byte moves, wherever the plugin reads them (on the caller's
    thread or later). Its other facts (caches' geometry, layout and device, pairs, sizes,
    direction) read as usual."""

    def __getattribute__(self, name: str) -> Any:
        if name in ("descriptors", "runs", "families"):
            raise _injected()
        if name == "num_bytes":
            return object.__getattribute__(self, "_num_bytes")
        return object.__getattribute__(self, name)


def failing_plan(plan: CopyPlan) -> FailingPlan:
    fields = {f.name: object.__getattribute__(plan, f.name) for f in dataclasses.fields(CopyPlan)}
    fields["src"], fields["dst"] = failing_cache(plan.src), failing_cache(plan.dst)
    failing = FailingPlan(**fields)
    object.__setattr__(failing, "_num_bytes", plan.num_bytes)
    return failing
