"""Two chained copies (host -> device, then device -> host of the same blocks) and their verdicts.

The second copy reads first what the first writes last (``64``-byte pieces,
reversed), so a second copy that starts before the first has finished, on one
stream or on a stream that waits for the first's event, reads stale blocks.
Every verdict rests on data; when bytes never arrive, the copy itself is wrong,
and the failure says so instead of blaming the streams.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvhal.copyplan import CopyPlan
from kvhal.device import Device
from kvhal_conformance import blockdata, guarded
from kvhal_conformance.clauses import violated
from kvhal_conformance.copycase import CONTROL_BUSY_S, piece_geometry, query_lies, reversed_pairs, sample_rows
from kvhal_conformance.copycheck import mapped_problems
from kvhal_conformance.timing import Busy, poll, settle, wait

#: Where the blame lies when the chain's bytes never arrive: the copy, not the streams.
COPY_WRONG = (
    "kvhal_copy_blocks copied this batch wrong (the copies contract checks a copy of the same size "
    "alone: test_block_sizes[...-large])"
)


def _size(plan: CopyPlan) -> str:
    return f"{plan.num_bytes >> 20} MiB in {plan.num_blocks} blocks"


@dataclass(repr=False)
class Chain:
    """``first`` (host -> device, reversed) then ``second`` (device -> host, ascending): the
    second reads first what the first writes last."""

    device: Device
    busy: Busy
    first: CopyPlan
    second: CopyPlan
    end_to_end: np.ndarray
    busy_s: float = 0.0
    host_data: blockdata.Snapshot = ()
    middle_before: blockdata.Snapshot = ()
    out_before: blockdata.Snapshot = ()

    def __repr__(self) -> str:  # the snapshots are large; tracebacks print this
        return f"Chain({self.device!r}, {self.first.num_blocks} blocks)"

    def reset(self, seed: int) -> None:
        """New contents everywhere a check looks, written before any copy starts."""
        self.host_data = blockdata.fill(self.first.src, seed)
        self.middle_before = blockdata.fill(self.first.dst, seed + 1)
        self.out_before = blockdata.clear(self.second.dst)
        settle(self.device)

    def occupy(self, stream: Any, seconds: float) -> Any:
        """Keep ``stream`` busy for at least ``seconds``; the last busy copy's event."""
        event, self.busy_s = self.busy.occupy(stream, seconds)
        return event

    def submit(self, plan: CopyPlan, stream: Any) -> Any:
        return self.device.submit(plan, stream, after_compute=False)

    def second_changed(self) -> bool:
        rows = sample_rows(self.second.mapping)
        got = blockdata.read(self.second.dst, rows[:, 1])
        return not bool(blockdata.blocks_equal(got, blockdata.take(self.out_before, rows[:, 1])).all())

    def expect_after(
        self,
        clauses: str | Sequence[str],
        earlier: Any,
        last: Any,
        what: str,
        started_early: str,
        read_early: str,
        earlier_is_first: bool = False,
    ) -> None:
        """Watch ``second`` (event ``last``), which must follow the work of event ``earlier``
        (``earlier_is_first``: the event ``first`` returned): fail (naming ``clauses``) if it
        writes before ``earlier`` completes, or if it did not read what ``first`` wrote."""

        def not_started() -> None:
            if self.second_changed() and not self.device.query_event(earlier):
                violated(clauses, f"{what}: {started_early}")

        poll(self.device, earlier, "the work a copy must follow", while_pending=not_started)
        if earlier_is_first and not self._first_arrived() and self._arrives_later(self._first_arrived):
            if query_lies(self.device, self.busy, CONTROL_BUSY_S):
                violated(
                    "query.state",
                    f"{what}: kvhal_query_event reported the host->device copy's event complete before its "
                    "bytes were written, and it also reports the event of a copy submitted a moment before "
                    "behind busy work complete: a query must report an incomplete event incomplete",
                )
            violated(
                "copy.event",
                f"{what}: the event of the host->device copy reported complete before its bytes were "
                "written (they were written later): the event kvhal_copy_blocks returns must complete "
                "only after every byte is written",
            )
        looked = wait(
            self.device,
            last,
            "the last of two chained copies",
            then=lambda: (self.device.query_event(last), self._arrived()),
        )
        assert looked is not None
        complete, arrived = looked  # the event's state first, the moment synchronize returned
        if not arrived and self._arrives_later():
            state = "complete" if complete else "incomplete"
            violated(
                "copy.event" if complete else "sync.waits",
                f"{what}: kvhal_synchronize_event returned for the last copy's event (which then queried "
                f"{state}), but its blocks were written only later: it must return only once every byte "
                "is written",
            )
        self.expect_read(clauses, what, read_early)

    def _arrives_later(self, done: Callable[[], bool] | None = None, limit_s: float = 1.0) -> bool:
        done = done or self._arrived
        deadline = time.perf_counter() + limit_s
        while time.perf_counter() < deadline:
            if done():
                return True
            time.sleep(0.005)
        return False

    def _first_arrived(self) -> bool:
        rows = sample_rows(self.first.mapping)
        got = blockdata.read(self.first.dst, rows[:, 1])
        return bool(blockdata.blocks_equal(got, blockdata.take(self.host_data, rows[:, 0])).all())

    def _arrived(self) -> bool:
        src_ids, dst_ids = self.end_to_end.T
        got = blockdata.read(self.second.dst, dst_ids)
        return bool(blockdata.blocks_equal(got, blockdata.take(self.host_data, src_ids)).all())

    def expect_read(self, clauses: str | Sequence[str], what: str, order_violation: str) -> None:
        """Fail unless ``second``, whose event was synchronized, read exactly what ``first``
        wrote; say which went wrong."""
        if self._arrived():
            return
        middle = blockdata.read(self.first.dst)
        first = mapped_problems(self.first.mapping, self.host_data, self.middle_before, middle)
        if first:
            violated(
                "copy.data",
                f"{what}: the host->device copy ({_size(self.first)}) never delivered its blocks: "
                f"{COPY_WRONG}: " + "; ".join(first),
            )
        out = blockdata.read(self.second.dst)
        src_ids, dst_ids = self.second.mapping.T
        stale = blockdata.blocks_equal(
            blockdata.take(out, dst_ids), blockdata.take(self.middle_before, src_ids)
        )
        if stale.any():
            ids = blockdata.id_list(dst_ids[stale.numpy()])
            violated(
                clauses,
                f"{what}: {order_violation}: dst blocks {ids} hold what the device blocks held before the "
                "first copy wrote them",
            )
        second = mapped_problems(self.second.mapping, middle, self.out_before, out)
        violated(
            "copy.data",
            f"{what}: the device->host copy ({_size(self.second)}) is wrong ({COPY_WRONG}, or it read "
            "blocks while the first copy was writing them): " + "; ".join(second),
        )


def make_chain(device: Device, busy: Busy, nbytes: int) -> Chain:
    """Allocate the chain's caches (in ``busy``'s layout); free them with :func:`free_chain`."""
    layout = busy.src.layout
    geometry = piece_geometry(nbytes)
    host_in = guarded.host_cache(device, geometry, layout, geometry.num_blocks)
    middle = guarded.kv_cache(device, geometry, layout)
    host_out = guarded.host_cache(device, geometry, layout, geometry.num_blocks)
    ids = np.arange(geometry.num_blocks)
    return Chain(
        device,
        busy,
        first=device.plan_copy(host_in, middle, reversed_pairs(geometry.num_blocks)),
        second=device.plan_copy(middle, host_out, np.stack([ids, ids], axis=1)),
        end_to_end=reversed_pairs(geometry.num_blocks),  # host_in block i ends in host_out n-1-i
    )


def free_chain(chain: Chain) -> None:
    for cache in (chain.first.src, chain.second.dst):
        guarded.free_cache(chain.device, cache)
