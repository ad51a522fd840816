"""The caches and verdicts of the streams-and-events checks.

The copies watched here move 64-byte pieces, hundreds of thousands of them, so
that each takes long enough to be caught half done on any device (a fast bulk
copy would be over before a check could look). Every verdict rests on data: an
event reported complete while bytes of its copy are missing (and arrive later),
or a later copy reading what an earlier one had not written yet. When bytes never
arrive, the copy itself is wrong, and the failure says so instead of blaming the events.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

from kvhal.copyplan import CopyPlan
from kvhal.device import Device
from kvhal.geometry import KVGeometry
from kvhal_conformance import blockdata
from kvhal_conformance.copycheck import mapped_problems
from kvhal_conformance.timing import Busy, poll, settle, wait

SAMPLES = 16
COPY_WRONG = "the copy itself is wrong (see the copies contract)"
EARLY_EVENT = (
    "but dst blocks {ids} of that copy were written only later: the event kvhal_copy_blocks returns "
    "must complete only after every byte is written"
)
WRONG_STREAM = (
    "but dst blocks {ids} of the copy submitted before it were written only later: kvhal_copy_blocks "
    "must run the copy on the stream it is given"
)


def reversed_pairs(n: int) -> np.ndarray:
    """Source ids ascending to destination ids descending: the copy's last writes are the
    blocks a following ascending read takes first."""
    ids = np.arange(n)
    return np.stack([ids, ids[::-1]], axis=1)


def sample_rows(mapping: np.ndarray) -> np.ndarray:
    """Evenly spaced rows of a mapping, its first and last included."""
    return mapping[np.unique(np.linspace(0, len(mapping) - 1, SAMPLES).round().astype(int))]


@dataclass(repr=False)
class Rig:
    """The copies the checks submit, and their expected results.

    ``watched``: device -> host, reversed; its destination is sampled while the copy may
    still run. ``chain_in`` (host -> device, reversed) then ``chain_out`` (device -> host,
    ascending): the second reads first what the first writes last.
    """

    device: Device
    busy: Busy
    watched: CopyPlan
    watched_data: blockdata.Snapshot
    chain_in: CopyPlan
    chain_out: CopyPlan
    chain_end_to_end: np.ndarray
    watched_s: float = 0.0
    busy_s: float = 0.0
    started: float = 0.0
    watched_before: blockdata.Snapshot = ()
    host_data: blockdata.Snapshot = ()
    middle_before: blockdata.Snapshot = ()
    chain_before: blockdata.Snapshot = ()

    def __repr__(self) -> str:  # the snapshots are large; tracebacks print this
        return f"Rig({self.device!r}, watched {self.watched.num_blocks} blocks)"

    def reset(self, seed: int) -> None:
        """New contents everywhere a check looks, written before any copy starts."""
        self.watched_before = blockdata.clear(self.watched.dst)
        self.host_data = blockdata.fill(self.chain_in.src, seed)
        self.middle_before = blockdata.fill(self.chain_in.dst, seed + 1)
        self.chain_before = blockdata.clear(self.chain_out.dst)
        settle(self.device)

    def occupy(self, stream: Any, seconds: float) -> Any:
        """Keep ``stream`` busy for at least ``seconds``; the last busy copy's event."""
        event, self.busy_s = self.busy.occupy(stream, seconds)
        return event

    def submit(self, plan: CopyPlan, stream: Any) -> Any:
        return self.device.submit(plan, stream, after_compute=False)

    def watched_after_busy(self, seed: int, seconds: float) -> tuple[Any, Any]:
        """Reset, keep a new stream busy for ``seconds`` (from ``self.started``), then submit
        the watched copy to it: (the stream, the copy's event)."""
        self.reset(seed)
        stream = self.device.create_stream()
        self.started = time.perf_counter()
        self.occupy(stream, seconds)
        return stream, self.submit(self.watched, stream)

    # -- the watched copy ---------------------------------------------------

    def watched_missing(self) -> np.ndarray:
        """Sampled destination blocks of the watched copy that do not hold their source yet,
        the copy's last writes looked at first."""
        rows = sample_rows(self.watched.mapping)[::-1]
        got = blockdata.read(self.watched.dst, rows[:, 1])
        ok = blockdata.blocks_equal(got, blockdata.take(self.watched_data, rows[:, 0])).numpy()
        return rows[~ok, 1]

    def _arrives(self, done: Callable[[], bool], limit_s: float | None = None) -> bool:
        """Whether ``done()`` turns true within a generous time (work still landing)."""
        limit_s = 0.5 + 10 * self.busy_s + 4 * self.watched_s if limit_s is None else limit_s
        deadline = time.perf_counter() + limit_s
        while time.perf_counter() < deadline:
            if done():
                return True
            time.sleep(0.005)
        return False

    def expect_watched_written(
        self, when: str, tail: str = EARLY_EVENT, missing: np.ndarray | None = None
    ) -> None:
        """Fail unless the sampled destination blocks of the watched copy hold their source
        (``missing``: what a check already saw missing the moment it looked)."""
        missing = self.watched_missing() if missing is None else missing
        if not len(missing):
            return
        if self._arrives(lambda: not len(self.watched_missing())):
            pytest.fail(f"{when}, " + tail.format(ids=blockdata.id_list(missing)))
        pytest.fail(
            f"{when}, but the copy never delivered its blocks: {COPY_WRONG}: " + self.watched_problems()
        )

    def watched_problems(self) -> str:
        after = blockdata.read(self.watched.dst)
        return "; ".join(mapped_problems(self.watched.mapping, self.watched_data, self.watched_before, after))

    # -- the chained copies -------------------------------------------------

    def chain_changed(self) -> bool:
        """Whether any sampled destination block of ``chain_out`` changed."""
        rows = sample_rows(self.chain_out.mapping)
        got = blockdata.read(self.chain_out.dst, rows[:, 1])
        return not bool(blockdata.blocks_equal(got, blockdata.take(self.chain_before, rows[:, 1])).all())

    def expect_chain_after(
        self, earlier: Any, last: Any, what: str, started_early: str, read_early: str
    ) -> None:
        """Watch ``chain_out`` (event ``last``), which must follow the work of event ``earlier``:
        fail if it writes before ``earlier`` completes, or if it did not read what ``chain_in`` wrote."""

        def not_started() -> None:
            if self.chain_changed() and not self.device.query_event(earlier):
                pytest.fail(f"{what}: {started_early}")

        poll(self.device, earlier, "the work a copy must follow", while_pending=not_started)
        wait(self.device, last, "the last of two chained copies")
        self.expect_chain(what, read_early)

    def _chain_arrived(self) -> bool:
        src_ids, dst_ids = self.chain_end_to_end.T
        got = blockdata.read(self.chain_out.dst, dst_ids)
        return bool(blockdata.blocks_equal(got, blockdata.take(self.host_data, src_ids)).all())

    def expect_chain(self, what: str, order_violation: str) -> None:
        """Fail unless ``chain_out``, whose event was synchronized, read exactly what ``chain_in``
        wrote; say which went wrong."""
        if self._chain_arrived():
            return
        if self._arrives(self._chain_arrived):
            pytest.fail(
                f"{what}: kvhal_synchronize_event returned for the last copy's event, but its blocks were "
                "written only later: the event kvhal_copy_blocks returns must complete only after every "
                "byte is written"
            )
        middle = blockdata.read(self.chain_in.dst)
        first = mapped_problems(self.chain_in.mapping, self.host_data, self.middle_before, middle)
        if first:
            pytest.fail(
                f"{what}: the host->device copy never delivered its blocks: {COPY_WRONG}: " + "; ".join(first)
            )
        out = blockdata.read(self.chain_out.dst)
        src_ids, dst_ids = self.chain_out.mapping.T
        stale = blockdata.blocks_equal(
            blockdata.take(out, dst_ids), blockdata.take(self.middle_before, src_ids)
        )
        if stale.any():
            ids = blockdata.id_list(dst_ids[stale.numpy()])
            pytest.fail(
                f"{what}: {order_violation}: dst blocks {ids} hold what the device blocks held before the "
                "first copy wrote them"
            )
        second = mapped_problems(self.chain_out.mapping, middle, self.chain_before, out)
        pytest.fail(
            f"{what}: the device->host copy is wrong ({COPY_WRONG}, or it read blocks while the first "
            "copy was writing them): " + "; ".join(second)
        )


def piece_geometry(nbytes: int) -> KVGeometry:
    """bf16, 2 layers, one token of one 16-wide head: 64-byte pieces, ``nbytes`` in all."""
    g = KVGeometry(
        num_layers=2, num_blocks=1, block_size=1, num_kv_heads=1, head_size=16, dtype=torch.bfloat16
    )
    return g.with_num_blocks(max(64, nbytes // g.block_bytes))


def make_rig(device: Device, busy: Busy, watched_bytes: int) -> Rig:
    """Allocate the rig's caches (in ``busy``'s layout); free them with :func:`free_rig`."""
    layout = busy.src.layout
    big, small = piece_geometry(watched_bytes), piece_geometry(watched_bytes // 4)
    watched_src = device.allocate_kv_cache(big, layout)
    watched_data = blockdata.fill(watched_src, seed=0x3A7C)
    watched_dst = device.allocate_host_cache(big, layout, big.num_blocks)
    host_in = device.allocate_host_cache(small, layout, small.num_blocks)
    middle = device.allocate_kv_cache(small, layout)
    host_out = device.allocate_host_cache(small, layout, small.num_blocks)
    ids = np.arange(small.num_blocks)
    rig = Rig(
        device,
        busy,
        watched=device.plan_copy(watched_src, watched_dst, reversed_pairs(big.num_blocks)),
        watched_data=watched_data,
        chain_in=device.plan_copy(host_in, middle, reversed_pairs(small.num_blocks)),
        chain_out=device.plan_copy(middle, host_out, np.stack([ids, ids], axis=1)),
        chain_end_to_end=reversed_pairs(small.num_blocks),  # host_in block i ends in host_out n-1-i
    )
    # How long the watched copy takes (until its bytes are there, whatever its event says), to
    # know how long to wait for late bytes; and no check may start while it still writes.
    start = time.perf_counter()
    wait(device, rig.submit(rig.watched, device.create_stream()), "a first copy of 64-byte pieces")
    rig.watched_s = time.perf_counter() - start
    if rig._arrives(lambda: not len(rig.watched_missing()), limit_s=2.0):  # bytes that never come: no time
        rig.watched_s = time.perf_counter() - start
    return rig


def free_rig(rig: Rig) -> None:
    for cache in (rig.watched.dst, rig.chain_in.src, rig.chain_out.dst):
        rig.device.free_host_cache(cache)
