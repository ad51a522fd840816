"""Contract: block copies (``kvhal_copy_blocks``), checked byte for byte.

Source and destination are filled with a different pattern in every block;
after the copy, every mapped destination block must hold its source block,
every other destination block its old contents, and the source must be
unchanged.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

from kvhal.cache import KVCache
from kvhal.device import Device
from kvhal.geometry import KVFormat, KVGeometry
from kvhal.layouts import KVLayout
from kvhal_conformance import blockdata, guarded
from kvhal_conformance.base.fixtures import ContractFixtures, HostCache, final
from kvhal_conformance.cases import (
    LAYOUT_KINDS,
    describe,
    layout_of_kind,
    offered_layouts,
    require_dtype,
    require_format,
    small_geometry,
)
from kvhal_conformance.clauses import DIRECTIONS, SIZES, covers, depends_on, violated
from kvhal_conformance.copycase import LATE_LIMIT_S, CopyCase, synchronize_and_check
from kvhal_conformance.copycheck import mapped_problems, source_problems, unmapped_problems
from kvhal_conformance.settings import Sizes
from kvhal_conformance.target import Target
from kvhal_conformance.timing import scratch_geometry, settle, wait

#: What every check of a finished copy covers.
COPY_CLAUSES = ("copy.data", "copy.dst_only", "copy.src_unchanged")
#: The copies are judged through the caches' views: with views not laid out as labelled, a
#: right copy reads wrong and a wrong one may read right (not judged when these fail).
LAYOUT_CLAUSES = ("alloc.layout", "alloc.cross_layer")
DEVICE_BLOCKS, HOST_BLOCKS = 40, 24
MAPPINGS = ("random", "empty", "one", "last", "noncontiguous", "coalescable", "fan_out")


def make_mapping(kind: str, rng: np.random.Generator, n_src: int, n_dst: int) -> np.ndarray:
    """``(src, dst)`` rows of one kind; both sides have at least 24 blocks."""
    if kind == "random":
        k = 12
        pairs = np.stack([rng.choice(n_src, k, replace=False), rng.choice(n_dst, k, replace=False)], axis=1)
    elif kind == "empty":
        pairs = np.zeros((0, 2))
    elif kind == "one":
        pairs = np.array([[rng.integers(n_src), rng.integers(n_dst)]])
    elif kind == "last":
        pairs = np.array([[n_src - 1, 1], [0, n_dst - 1], [n_src // 2, n_dst // 2]])
    elif kind == "noncontiguous":
        pairs = np.stack([np.arange(0, 16, 2), np.arange(1, 24, 3)], axis=1)
    elif kind == "coalescable":  # two runs of consecutive ids on both sides
        pairs = np.concatenate(
            [
                np.stack([np.arange(3, 11), np.arange(12, 20)], axis=1),
                np.stack([np.arange(15, 19), np.arange(4)], axis=1),
            ]
        )
    elif kind == "fan_out":  # one source block to several destinations
        pairs = np.array([[5, 1], [5, 9], [5, 17], [6, 2]])
    else:
        raise ValueError(kind)
    return pairs.astype(np.int64)


@dataclass
class Copier:
    """Runs checked copies: a fresh device cache and host cache each, every byte compared."""

    target: Target
    device: Device
    host_cache: HostCache
    rng: np.random.Generator
    seed: int

    def layout(self, kind: str) -> KVLayout:
        return layout_of_kind(self.target, self.device, kind)

    def mapping(self, kind: str, direction: str) -> np.ndarray:
        sides = (DEVICE_BLOCKS, HOST_BLOCKS) if direction == "d2h" else (HOST_BLOCKS, DEVICE_BLOCKS)
        return make_mapping(kind, self.rng, *sides)

    def check(
        self,
        geometry: KVGeometry,
        layout: KVLayout,
        direction: str,
        mapping: np.ndarray,
        what: str,
        host_blocks: int = HOST_BLOCKS,
    ) -> None:
        """Copy ``mapping`` between a new device cache and a new host cache; check every byte."""
        device = self.device
        on_device = guarded.kv_cache(device, geometry, layout)
        on_host = self.host_cache(geometry, layout, host_blocks)
        src, dst = (on_device, on_host) if direction == "d2h" else (on_host, on_device)
        src_before, dst_before = blockdata.fill(src, self.seed), blockdata.fill(dst, self.seed + 1)
        settle(device)
        context = f"kvhal_copy_blocks ({direction}, {describe(layout, geometry)}, {what})"
        event = device.copy_blocks(src, dst, mapping)
        complete = wait(device, event, context, then=lambda: device.query_event(event))
        if not complete:  # either synchronize returned early, or the query is wrong
            if late(lambda: device.query_event(event)):
                violated(
                    "sync.waits",
                    f"{context}: kvhal_synchronize_event returned while the copy's event still queried "
                    "incomplete (it reported complete later): it must return only once the event completes",
                )
            violated(
                "query.state",
                f"{context}: kvhal_query_event reports a copy incomplete after "
                "kvhal_synchronize_event returned for it: a query must report complete once the work "
                "has completed",
            )
        dst_after = blockdata.read(dst)
        problems = [("copy.data", p) for p in mapped_problems(mapping, src_before, dst_before, dst_after)]
        if problems and lands_late(
            dst, lambda got: not mapped_problems(mapping, src_before, dst_before, got)
        ):
            violated(
                "copy.event",
                f"{context}: kvhal_synchronize_event returned, and the event queried complete, before the "
                "copy's bytes were written (they arrived later): the event must complete only when every "
                "byte is written. " + blockdata.mapping_preview(mapping),
            )
        problems += [("copy.dst_only", p) for p in unmapped_problems(mapping, dst_before, dst_after)]
        problems += [("copy.src_unchanged", p) for p in source_problems(src_before, blockdata.read(src))]
        if problems:
            clauses = tuple(dict.fromkeys(c for c, _ in problems))
            violated(
                clauses,
                f"{context}: "
                + "; ".join(p for _, p in problems)
                + ". "
                + blockdata.mapping_preview(mapping),
            )


def lands_late(
    cache: KVCache, correct: Callable[[blockdata.Snapshot], bool], limit_s: float = LATE_LIMIT_S
) -> bool:
    """Whether ``cache`` turns ``correct`` within ``limit_s`` (bytes written after their event
    completed); False as soon as it stays unchanged for 0.1 s (wrong data, not late data)."""
    start = time.perf_counter()
    last, since = blockdata.read(cache), start
    while time.perf_counter() - start < limit_s:
        time.sleep(0.005)
        now, got = time.perf_counter(), blockdata.read(cache)
        if correct(got):
            return True
        if not bool(blockdata.blocks_equal(got, last).all()):
            last, since = got, now
        elif now - since > 0.1:
            return False
    return False


def late(done: Callable[[], bool], limit_s: float = LATE_LIMIT_S) -> bool:
    """Whether ``done()`` turns true within ``limit_s``: bytes written after their event completed."""
    deadline = time.perf_counter() + limit_s
    while time.perf_counter() < deadline:
        time.sleep(0.01)
        if done():
            return True
    return False


class CopiesContract(ContractFixtures):
    """Contract ``copies``: in both directions, layer-separate and cross-layer, for random and
    edge-case mappings, every required and declared dtype, stacked and split K/V, one small
    block, one odd-sized block and many MiB, every mapped block arrives bit for bit, no other
    destination byte changes and the source stays as it was.

    Fixtures: ``kvhal_target``, ``kvhal_device``, ``kvhal_sizes`` (``large_batch``, ``scratch_bytes``,
    ``large_copy_bytes``), ``kvhal_host_cache``, ``kvhal_seed``, ``kvhal_rng``,
    ``kvhal_new_stream`` (see :class:`ContractFixtures`); ``copier`` (function) runs the
    checked copies.

    Hooks: :meth:`~ContractFixtures.dtypes_to_check`.
    """

    contract_id = "copies"

    @pytest.fixture
    def copier(
        self,
        kvhal_target: Target,
        kvhal_device: Device,
        kvhal_host_cache: HostCache,
        kvhal_rng: np.random.Generator,
        kvhal_seed: int,
    ) -> Copier:
        return Copier(kvhal_target, kvhal_device, kvhal_host_cache, kvhal_rng, kvhal_seed)

    @final
    @covers(*COPY_CLAUSES)
    @depends_on(*LAYOUT_CLAUSES)
    @pytest.mark.parametrize("layout_kind", LAYOUT_KINDS)
    @pytest.mark.parametrize("direction", DIRECTIONS)
    @pytest.mark.parametrize("kind", MAPPINGS)
    def test_mapping(self, copier: Copier, kind: str, direction: str, layout_kind: str) -> None:
        """Random, empty, one-block, last-block, non-contiguous, coalescable and fan-out mappings
        copy exactly."""
        layout = copier.layout(layout_kind)
        copier.check(
            small_geometry(), layout, direction, copier.mapping(kind, direction), f"mapping '{kind}'"
        )

    @final
    @covers(*COPY_CLAUSES)
    @depends_on(*LAYOUT_CLAUSES)
    @pytest.mark.parametrize("layout_kind", LAYOUT_KINDS)
    @pytest.mark.parametrize("direction", DIRECTIONS)
    def test_dtype(self, copier: Copier, dtype: torch.dtype, direction: str, layout_kind: str) -> None:
        """bf16, fp16, fp32 (required) and every dtype the plugin declares (``dtype.*``) copy bit for bit."""
        require_dtype(copier.target, dtype)
        layout = copier.layout(layout_kind)
        geometry = small_geometry(dtype)
        copier.check(geometry, layout, direction, copier.mapping("random", direction), "random mapping")

    @final
    @covers(*COPY_CLAUSES)
    @depends_on(*LAYOUT_CLAUSES)
    @pytest.mark.parametrize("layout_kind", LAYOUT_KINDS)
    @pytest.mark.parametrize("direction", DIRECTIONS)
    def test_split_kv(self, copier: Copier, direction: str, layout_kind: str) -> None:
        """Caches kept as a (K, V) pair per layer copy both parts (when kv.split is declared)."""
        require_format(copier.target, KVFormat.SPLIT)
        layout = copier.layout(layout_kind)
        geometry = small_geometry(kv_format=KVFormat.SPLIT)
        copier.check(geometry, layout, direction, copier.mapping("random", direction), "random mapping")

    @final
    @covers(*COPY_CLAUSES)
    @depends_on(*LAYOUT_CLAUSES)
    @pytest.mark.parametrize("layout_kind", LAYOUT_KINDS)
    @pytest.mark.parametrize("direction", DIRECTIONS)
    def test_large_batch(self, copier: Copier, kvhal_sizes: Sizes, direction: str, layout_kind: str) -> None:
        """Every block of a large cache, scattered on the device side, copies in one batch."""
        layout = copier.layout(layout_kind)
        n = kvhal_sizes.large_batch
        geometry = small_geometry(num_blocks=n, num_layers=2)
        scattered, packed = copier.rng.permutation(n), np.arange(n)
        pairs = (scattered, packed) if direction == "d2h" else (packed, scattered)
        copier.check(geometry, layout, direction, np.stack(pairs, axis=1), f"{n} blocks", host_blocks=n)

    @final
    @covers(*COPY_CLAUSES)
    @depends_on(*LAYOUT_CLAUSES)
    @pytest.mark.parametrize("direction", DIRECTIONS)
    def test_busy_work_batch(self, copier: Copier, kvhal_sizes: Sizes, direction: str) -> None:
        """The batch the streams-and-events checks keep streams busy with (every block of the
        scratch cache, ``scratch_bytes`` in all: their largest copy) copies exactly."""
        geometry = scratch_geometry(kvhal_sizes.scratch_bytes)
        n = geometry.num_blocks
        ids = np.arange(n)
        layout = copier.device.kv_layouts()[0]  # the busy work's layout
        what = f"the streams checks' busy-work batch: {n} blocks, {geometry.total_bytes >> 20} MiB"
        copier.check(geometry, layout, direction, np.stack([ids, ids], axis=1), what, host_blocks=n)

    @final
    @covers(*COPY_CLAUSES)
    @depends_on(*LAYOUT_CLAUSES)
    @pytest.mark.parametrize("direction", DIRECTIONS)
    def test_every_offered_layout(self, copier: Copier, direction: str) -> None:
        """A random mapping copies exactly in every layout kvhal_kv_layouts(None) offers."""
        for layout in offered_layouts(copier.target, copier.device):
            copier.check(
                small_geometry(), layout, direction, copier.mapping("random", direction), "random mapping"
            )

    @final
    @covers(*COPY_CLAUSES)
    @depends_on(*LAYOUT_CLAUSES)
    @pytest.mark.parametrize("size", SIZES)
    @pytest.mark.parametrize("direction", DIRECTIONS)
    @pytest.mark.parametrize("layout_kind", LAYOUT_KINDS)
    def test_block_sizes(
        self,
        copier: Copier,
        kvhal_sizes: Sizes,
        kvhal_new_stream: Callable[[], Any],
        layout_kind: str,
        direction: str,
        size: str,
    ) -> None:
        """One block of 4 KiB, one of 1386 bytes (no multiple of a page or a vector width) and a
        batch of many MiB copy exactly, their neighbours untouched."""
        case = CopyCase.make(
            copier.device, copier.layout(layout_kind), direction, size, kvhal_sizes, copier.seed, copier.rng
        )
        try:
            event = case.submit(kvhal_new_stream())
            synchronize_and_check(
                copier.device, event, case, "copy.event", f"kvhal_copy_blocks ({layout_kind})"
            )
        finally:
            case.free()
