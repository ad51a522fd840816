"""One block copy whose every byte can be checked: either direction, three sizes.

``small`` is one block of 4 KiB; ``odd`` one block of 1386 bytes (462 per layer:
no multiple of a page, of 64 bytes or of 16); ``large`` a batch of many MiB in
64-byte pieces, long enough to be caught half done on any device. Source and
destination hold a different pattern in every block, so a copy that writes the
wrong block, too few bytes or one byte too many is named.

The verdicts on events (:func:`judge_query`, :func:`judge_sync`) decide, from data,
which promise an early completion broke: the event itself (it also synchronizes
while bytes are missing), the query (synchronize then waits for them), or
synchronize (the event still queries incomplete when it returned).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, NoReturn

import numpy as np
import torch

from kvhal.cache import KVCache
from kvhal.copyplan import CopyPlan
from kvhal.device import Device
from kvhal.geometry import KVGeometry
from kvhal.layouts import KVLayout
from kvhal_conformance import blockdata, guarded
from kvhal_conformance.clauses import SIZES, violated
from kvhal_conformance.copycheck import mapped_problems, source_problems, unmapped_problems
from kvhal_conformance.settings import Sizes
from kvhal_conformance.timing import Busy, settle, wait

__all__ = ["SIZES", "CopyCase", "case_geometry", "judge_query", "judge_sync", "piece_geometry"]

#: Destination blocks sampled while a large copy may still run (its first and last included).
SAMPLES = 16
#: Blocks on each side of a one-block copy: the copied block has neighbours on both sides.
ONE_BLOCK_CACHE = 8
#: Busy work behind which a control event must still be pending when asked about at once
#: (long enough for a test thread that is descheduled for a while on a loaded machine).
CONTROL_BUSY_S = 0.2
#: How long bytes that are late (written after their event completed) may take to land, for
#: one block and for a large copy.
LATE_LIMIT_S = 0.3
LATE_LIMIT_LARGE_S = 1.0


def piece_geometry(nbytes: int) -> KVGeometry:
    """bf16, 2 layers, one token of one 16-wide head: 64-byte pieces, ``nbytes`` in all."""
    g = KVGeometry(
        num_layers=2, num_blocks=1, block_size=1, num_kv_heads=1, head_size=16, dtype=torch.bfloat16
    )
    return g.with_num_blocks(max(64, nbytes // g.block_bytes))


#: The bf16 blocks of the one-block sizes: (layers, tokens, heads, K head size, V head size).
ONE_BLOCK_SHAPES = {
    "small": (2, 16, 2, 16, 16),  # 2 layers x 2048 bytes
    "odd": (3, 3, 7, 5, 6),  # 3 layers x 462 bytes (7 heads x 3 tokens x (5 + 6) x 2 bytes)
}


def case_geometry(size: str, sizes: Sizes) -> KVGeometry:
    """The geometry of a copy of ``size`` (one of :data:`SIZES`, or :data:`BULK`)."""
    if size in ("large", BULK):
        return piece_geometry(sizes.large_copy_bytes)
    if size not in ONE_BLOCK_SHAPES:
        raise ValueError(f"size {size!r}: expected one of {SIZES}")
    layers, tokens, heads, head_size, head_size_v = ONE_BLOCK_SHAPES[size]
    return KVGeometry(
        num_layers=layers,
        num_blocks=ONE_BLOCK_CACHE,
        block_size=tokens,
        num_kv_heads=heads,
        head_size=head_size,
        dtype=torch.bfloat16,
        head_size_v=head_size_v,
    )


#: The large copy's bytes in consecutive blocks, which coalesce into a few descriptors: what
#: the non-blocking checks queue behind busy work. A device's queue holds only so many
#: operations: on an H200, a cuMemcpyBatchAsync of 32,768 descriptors (or cudaMemcpyAsync
#: calls) behind 300 ms of work returned only once that work was done; 2,048 returned in 3 ms.
BULK = "bulk"


def reversed_pairs(n: int) -> np.ndarray:
    """Source ids ascending to destination ids descending (nothing coalesces)."""
    ids = np.arange(n)
    return np.stack([ids, ids[::-1]], axis=1)


def sample_rows(mapping: np.ndarray, samples: int = SAMPLES) -> np.ndarray:
    """Evenly spaced rows of a mapping, its first and last included."""
    if len(mapping) <= samples:
        return mapping
    return mapping[np.unique(np.linspace(0, len(mapping) - 1, samples).round().astype(int))]


@dataclass(repr=False)
class CopyCase:
    """A copy between a new device cache and a new host cache, and what it must do."""

    device: Device
    plan: CopyPlan
    direction: str
    size: str
    src_before: blockdata.Snapshot
    dst_before: blockdata.Snapshot
    rows: np.ndarray

    def __repr__(self) -> str:
        return f"CopyCase({self.what})"

    @property
    def what(self) -> str:
        g = self.plan.src.geometry
        if self.size in ("large", BULK):
            blocks = len(self.plan.mapping)
            order = " consecutive" if self.size == BULK else ""
            return f"a {self.direction} copy of {self.plan.num_bytes >> 20} MiB in {blocks}{order} blocks"
        return f"a {self.direction} copy of one {g.block_bytes}-byte block ({self.size} size)"

    @classmethod
    def make(
        cls,
        device: Device,
        layout: KVLayout,
        direction: str,
        size: str,
        sizes: Sizes,
        seed: int,
        rng: np.random.Generator,
    ) -> CopyCase:
        geometry = case_geometry(size, sizes)
        if size == "large":
            mapping = reversed_pairs(geometry.num_blocks)
        elif size == BULK:
            mapping = np.repeat(np.arange(geometry.num_blocks)[:, None], 2, axis=1)
        else:  # one block between neighbours: a byte written past it lands in another block
            mapping = np.array([[rng.integers(ONE_BLOCK_CACHE), rng.integers(1, ONE_BLOCK_CACHE - 1)]])
        on_device = guarded.kv_cache(device, geometry, layout)
        on_host = guarded.host_cache(device, geometry, layout, geometry.num_blocks)
        src, dst = (on_device, on_host) if direction == "d2h" else (on_host, on_device)
        src_before, dst_before = blockdata.fill(src, seed), blockdata.fill(dst, seed + 1)
        plan = device.plan_copy(src, dst, mapping)
        settle(device)  # the fills above ran on the compute stream; the copies will not wait for it
        return cls(device, plan, direction, size, src_before, dst_before, sample_rows(plan.mapping))

    def rewind(self) -> None:
        """Clear the destination again, for another run of the same copy."""
        self.dst_before = blockdata.clear(self.plan.dst)
        settle(self.device)

    @property
    def host(self) -> KVCache:
        return self.plan.dst if self.direction == "d2h" else self.plan.src

    def free(self) -> None:
        guarded.free_cache(self.device, self.host)

    def submit(self, stream: Any) -> Any:
        return self.device.submit(self.plan, stream, after_compute=False)

    # -- looking while it may run ----------------------------------------------

    def missing(self) -> np.ndarray:
        """Sampled destination blocks that do not hold their source yet (the copy's last
        writes looked at first)."""
        rows = self.rows[::-1].copy()
        got = blockdata.read(self.plan.dst, rows[:, 1])
        ok = blockdata.blocks_equal(got, blockdata.take(self.src_before, rows[:, 0])).numpy()
        return rows[~ok, 1]

    def dst_changed(self) -> bool:
        """Whether any sampled destination block differs from its contents before the copy."""
        ids = self.rows[:, 1]
        got = blockdata.read(self.plan.dst, ids)
        return not bool(blockdata.blocks_equal(got, blockdata.take(self.dst_before, ids)).all())

    def arrives(self, limit_s: float | None = None) -> bool:
        """Whether the sampled missing blocks land within ``limit_s`` (bytes still landing)."""
        if limit_s is None:
            limit_s = LATE_LIMIT_LARGE_S if self.size == "large" else LATE_LIMIT_S
        start = time.perf_counter()
        last, since = None, start
        while True:
            if not len(self.missing()):
                return True
            now = time.perf_counter()
            if now - start > limit_s:
                return False
            # Blocks written with wrong data that stay as they are: no late bytes are coming.
            seen = blockdata.read(self.plan.dst, self.rows[:, 1])
            if last is None or not bool(blockdata.blocks_equal(seen, last).all()):
                last, since = seen, now
            elif now - since > 0.1 and len(self.garbled()):
                return False
            time.sleep(0.002)

    def unwritten(self) -> np.ndarray:
        """Sampled destination blocks that still hold what they held before the copy."""
        ids = self.rows[:, 1]
        got = blockdata.read(self.plan.dst, ids)
        return ids[blockdata.blocks_equal(got, blockdata.take(self.dst_before, ids)).numpy()]

    def garbled(self) -> np.ndarray:
        """Sampled destination blocks that hold neither their source nor what they held before."""
        ids = self.rows[:, 1]
        got = blockdata.read(self.plan.dst, ids)
        source = blockdata.blocks_equal(got, blockdata.take(self.src_before, self.rows[:, 0])).numpy()
        before = blockdata.blocks_equal(got, blockdata.take(self.dst_before, ids)).numpy()
        return ids[~source & ~before]

    # -- the finished copy -------------------------------------------------------

    def problems(self) -> list[tuple[str, str]]:
        """``(clause, sentence)`` for everything wrong with the finished copy."""
        mapping = self.plan.mapping
        dst_after = blockdata.read(self.plan.dst)
        found = [
            ("copy.data", p) for p in mapped_problems(mapping, self.src_before, self.dst_before, dst_after)
        ]
        found += [("copy.dst_only", p) for p in unmapped_problems(mapping, self.dst_before, dst_after)]
        found += [
            ("copy.src_unchanged", p) for p in source_problems(self.src_before, blockdata.read(self.plan.src))
        ]
        return found

    def expect_done(self, context: str) -> None:
        """Fail, naming the clauses, unless the finished copy is exactly right."""
        found = self.problems()
        if found:
            clauses = tuple(dict.fromkeys(c for c, _ in found))
            violated(clauses, f"{context}, {self.what}: " + "; ".join(p for _, p in found))

    def never_delivered(self, context: str) -> NoReturn:
        problems = "; ".join(p for _, p in self.problems()) or "sampled blocks were missing"
        violated(
            "copy.data",
            f"{context}, {self.what}: the copy never delivered its blocks: {problems}: every destination "
            "block of the plan must hold its source block's bytes once the copy's event completes",
        )


def _ids(ids: np.ndarray) -> str:
    return blockdata.id_list(ids)


def _query(device: Device, event: Any) -> bool | None:
    """The event's state, or None when querying it raised."""
    try:
        return device.query_event(event)
    except Exception:
        return None


def query_lies(device: Device, busy: Busy, seconds: float) -> bool:
    """Whether kvhal_query_event says complete for the event of a copy submitted a moment ago
    behind at least ``seconds`` of copies (which cannot have finished)."""
    event, _ = busy.occupy(device.create_stream(), seconds)
    lies = device.query_event(event)
    wait(device, event, "busy work")
    return lies


#: What each promise an early completion breaks asks for, in its failure message.
DEMANDS = {
    "copy.event": "the event kvhal_copy_blocks returns must complete only after every byte is written",
    "copy.on_stream": "kvhal_copy_blocks must run the copy on the stream it is given, so that an event "
    "recorded on that stream after it follows it",
    "record.after_work": "an event recorded with kvhal_record_event must complete only after all work "
    "submitted to its stream before it",
    "record.again": "an event recorded again must follow its new record",
}


def judge_query(
    device: Device, event: Any, case: CopyCase, missing: np.ndarray, clause: str, context: str, busy: Busy
) -> NoReturn:
    """``event`` queried complete while ``missing`` blocks of ``case`` were unwritten: fail,
    naming ``query.state`` when the query also calls the event of a copy just submitted
    behind busy work complete, else ``clause`` (the event completed early) when the bytes
    arrive later, else ``copy.data`` (they never arrive)."""
    if query_lies(device, busy, CONTROL_BUSY_S):
        violated(
            "query.state",
            f"{context}: kvhal_query_event reported the event of {case.what} complete while dst blocks "
            f"{_ids(missing)} were unwritten, and it also reports the event of a copy submitted a moment "
            "before behind busy work complete: a query must report an incomplete event incomplete",
        )
    if case.arrives():
        violated(
            clause,
            f"{context}: the event reported complete while dst blocks {_ids(missing)} of {case.what} were "
            f"unwritten, and they were written only later: {DEMANDS[clause]}",
        )
    case.never_delivered(context)


def judge_sync(
    device: Device, case: CopyCase, complete: bool | None, missing: np.ndarray, clause: str, context: str
) -> NoReturn:
    """kvhal_synchronize_event returned while ``missing`` blocks were unwritten and the event
    then queried ``complete``: fail, naming ``sync.waits`` (it queried incomplete) or
    ``clause`` (it queried complete: the event itself completed early); a copy that never
    delivers is ``copy.data``."""
    if not case.arrives():
        case.never_delivered(context)
    if complete is False:
        violated(
            "sync.waits",
            f"{context}: kvhal_synchronize_event returned while its event still queried incomplete and "
            f"dst blocks {_ids(missing)} of {case.what} were unwritten (written later): synchronize must "
            "block until the event completes",
        )
    violated(
        clause,
        f"{context}: kvhal_synchronize_event returned while dst blocks {_ids(missing)} of {case.what} were "
        f"unwritten, and they were written only later: {DEMANDS[clause]}",
    )


def synchronize_and_check(device: Device, event: Any, case: CopyCase, clause: str, context: str) -> None:
    """Synchronize ``event`` (the copy's own, or one recorded after it: ``clause``), then the
    sampled blocks must be there at once, and the finished copy exactly right."""

    def look() -> tuple[bool | None, np.ndarray]:
        return _query(device, event), case.missing()  # the event's state first, the moment sync returned

    looked = wait(device, event, context, then=look)
    assert looked is not None
    complete, missing = looked
    if len(missing):
        judge_sync(device, case, complete, missing, clause, context)
    case.expect_done(context)
