"""Contract: KV cache allocation (``kvhal_allocate_kv_cache``)."""

from __future__ import annotations

import pytest
import torch

from kvhal.cache import KVCache
from kvhal.descriptor import Capability
from kvhal.device import Device
from kvhal.errors import ValidationError
from kvhal.geometry import KVFormat, KVGeometry
from kvhal.layouts import STANDARD_LAYOUTS, KVLayout
from kvhal_conformance import blockdata, guarded
from kvhal_conformance.base.fixtures import ContractFixtures, final
from kvhal_conformance.cases import (
    FORMATS,
    describe,
    distinct_geometry,
    offered_layouts,
    require_dtype,
    require_format,
)
from kvhal_conformance.clauses import covers, expect, violated
from kvhal_conformance.settings import Sizes
from kvhal_conformance.target import MEMORY_HOOK, Target

HOOK = "kvhal_allocate_kv_cache"


def _mismatches(cache: object, geometry: KVGeometry, layout: KVLayout, device: Device) -> list[str]:
    """How a raw allocation result differs from what was asked for."""
    if not isinstance(cache, KVCache):
        return [f"returned {type(cache).__name__}; expected KVCache"]
    problems = []
    got = cache.geometry
    if got.dtype != geometry.dtype:
        problems.append(f"returned a cache of dtype {got.dtype}; asked for {geometry.dtype}")
    else:
        why = geometry.mismatch(got) or (
            f"num_blocks: {geometry.num_blocks} vs {got.num_blocks}"
            if got.num_blocks != geometry.num_blocks
            else None
        )
        if why:
            problems.append(f"returned a cache whose geometry differs from the one asked for ({why})")
    if cache.layout.stride_order != layout.stride_order:
        problems.append(f"returned a {cache.layout} cache; asked for {layout}")
    if cache.device.type != device.descriptor.torch_device_type:
        problems.append(
            f"returned a cache on {cache.device}; the device's torch type is "
            f"{device.descriptor.torch_device_type}"
        )
    return problems


def _expect_zeroed(cache: KVCache, what: str) -> None:
    """Fail ``alloc.zeroed`` unless every element is zero (counted where the cache lives, no
    copy of a large cache)."""
    nonzero = sum(int(view.count_nonzero()) for views in cache.layers for view in views)
    expect(
        nonzero == 0,
        "alloc.zeroed",
        f"{HOOK} ({what}): a new cache must be zeroed; {nonzero} elements are not zero",
    )


class AllocationContract(ContractFixtures):
    """Contract ``allocation``: ``kvhal_allocate_kv_cache`` returns the cache asked for (every
    required and declared dtype, every offered layout), zeroed, every element its own memory,
    and refuses what the device cannot hold with ValidationError.

    Fixtures: ``kvhal_target``, ``kvhal_device``, ``kvhal_sizes`` (see :class:`ContractFixtures`).

    Hooks: :meth:`undeclared_requests`, :meth:`~ContractFixtures.dtypes_to_check`.
    """

    contract_id = "allocation"

    def undeclared_requests(self, target: Target, device: Device) -> list[tuple[str, KVGeometry, KVLayout]]:
        """Allocations the plugin has not said it can hold, as ``(what, geometry, layout)``:
        each must be refused with ValidationError or allocated as asked.

        Default: float64, split K/V (unless ``kv.split`` is declared) and every standard layout
        not offered. Extend it (``super().undeclared_requests(...) + [...]``) with what your
        device cannot hold, e.g. a head size its kernels do not support.
        """
        offered = {layout.stride_order for layout in device.kv_layouts()}
        preferred = device.kv_layouts()[0]
        base = distinct_geometry()
        requests = [("dtype float64", distinct_geometry(dtype=torch.float64), preferred)]
        if not target.declares(Capability.SPLIT_KV):
            requests.append(("split K/V", distinct_geometry(KVFormat.SPLIT), preferred))
        for layout in STANDARD_LAYOUTS:
            if layout.stride_order not in offered:
                requests.append((f"layout {layout} (not offered)", base, layout))
        return requests

    @final
    @covers("alloc.as_asked")
    @pytest.mark.parametrize("fmt", FORMATS)
    def test_allocates_what_was_asked(
        self, kvhal_target: Target, kvhal_device: Device, dtype: torch.dtype, fmt: str
    ) -> None:
        """For every offered layout, the cache has the geometry, dtype, layout and device asked for
        (every required dtype and every ``dtype.*`` the plugin declares)."""
        require_format(kvhal_target, FORMATS[fmt])
        require_dtype(kvhal_target, dtype)
        geometry = distinct_geometry(FORMATS[fmt], dtype)
        for layout in offered_layouts(kvhal_target, kvhal_device):
            try:
                cache = kvhal_target.caller(HOOK)(
                    geometry=geometry, layout=layout, device=kvhal_device.torch_device
                )
            except Exception as exc:
                violated(
                    "alloc.as_asked",
                    f"{kvhal_target.label} hook {HOOK} ({describe(layout, geometry)}, declared) "
                    f"raised {type(exc).__name__}: {exc}",
                )
            problems = _mismatches(cache, geometry, layout, kvhal_device)
            expect(
                not problems,
                "alloc.as_asked",
                f"{HOOK} ({describe(layout, geometry)}): " + "; ".join(problems),
            )
            guarded.kv_cache(kvhal_device, geometry, layout)  # kvhal's own checks agree

    @final
    @covers("alloc.zeroed")
    @pytest.mark.parametrize("fmt", FORMATS)
    def test_cache_is_zeroed(
        self, kvhal_target: Target, kvhal_device: Device, kvhal_sizes: Sizes, fmt: str
    ) -> None:
        """A new cache is all zero bytes: small ones in every offered layout, and one of many MiB
        allocated again after one of its size was filled and dropped (memory a device allocator
        reuses must be cleared)."""
        require_format(kvhal_target, FORMATS[fmt])
        geometry = distinct_geometry(FORMATS[fmt])
        for layout in offered_layouts(kvhal_target, kvhal_device):
            _expect_zeroed(guarded.kv_cache(kvhal_device, geometry, layout), describe(layout, geometry))
        large = distinct_geometry(FORMATS[fmt]).with_num_blocks(1)
        large = large.with_num_blocks(max(1, kvhal_sizes.cache_bytes // large.block_bytes))
        layout = kvhal_device.kv_layouts()[0]
        for round_ in range(2):
            cache = guarded.kv_cache(kvhal_device, large, layout)
            again = " after one of the same size was filled and dropped" if round_ else ""
            what = f"{describe(layout, large)}, {large.total_bytes >> 20} MiB, allocation {round_ + 1}{again}"
            _expect_zeroed(cache, what)
            for views in cache.layers:
                for view in views:
                    view.fill_(1.5)
            del cache, views, view

    @final
    @covers("memory.report")
    def test_memory_report_follows_allocations(
        self, kvhal_target: Target, kvhal_device: Device, kvhal_sizes: Sizes
    ) -> None:
        """Where the plugin reports its device memory (the test hook kvhal_device_memory_in_use,
        which the first probe's measurement uses), a new cache of many MiB raises the report by
        at least its size (3 tries, each a new cache: memory freed elsewhere meanwhile is no
        violation unless it happens every time)."""
        report = kvhal_target.caller(MEMORY_HOOK)
        if report() is None:
            pytest.skip(
                f"device memory report: not implemented ({MEMORY_HOOK}); the first probe's device "
                "memory is measured through torch.accelerator where it sees the device"
            )
        geometry = distinct_geometry(FORMATS["stacked"]).with_num_blocks(1)
        geometry = geometry.with_num_blocks(max(1, kvhal_sizes.cache_bytes // geometry.block_bytes))
        layout = kvhal_device.kv_layouts()[0]
        seen = []
        for _ in range(3):
            before = report()
            cache = guarded.kv_cache(kvhal_device, geometry, layout)
            after = report()
            del cache
            for answer in (before, after):
                expect(
                    isinstance(answer, int) and not isinstance(answer, bool) and answer >= 0,
                    "memory.report",
                    f"{kvhal_target.label}: {MEMORY_HOOK}() returned {answer!r:.60}; expected an int of "
                    "at least 0",
                )
            seen.append(after - before)
            if after - before >= geometry.total_bytes:
                return
        violated(
            "memory.report",
            f"{kvhal_target.label}: {MEMORY_HOOK}() rose by {', '.join(str(d) for d in seen)} bytes while a "
            f"{geometry.total_bytes}-byte KV cache was allocated ({describe(layout, geometry)}, 3 tries): it "
            "must report the bytes of the plugin's live allocations, as its allocator counts them, so that a "
            "cache of N bytes raises it by at least N",
        )

    @final
    @covers("alloc.distinct")
    @pytest.mark.parametrize("fmt", FORMATS)
    def test_cache_elements_are_distinct(self, kvhal_target: Target, kvhal_device: Device, fmt: str) -> None:
        """For every offered layout, every element of a new cache has its own memory."""
        require_format(kvhal_target, FORMATS[fmt])
        geometry = distinct_geometry(FORMATS[fmt])
        for layout in offered_layouts(kvhal_target, kvhal_device):
            cache = guarded.kv_cache(kvhal_device, geometry, layout)
            written = blockdata.fill(cache, seed=len(layout.name))
            same = blockdata.blocks_equal(blockdata.read(cache), written)
            expect(
                bool(same.all()),
                "alloc.distinct",
                f"{HOOK} ({describe(layout, geometry)}): after writing a distinct value to every "
                f"element, blocks {blockdata.id_list(torch.nonzero(~same).flatten().tolist())} read back "
                "different values: views share memory",
            )

    @final
    @covers("alloc.refuses")
    def test_refuses_what_it_cannot_hold(self, kvhal_target: Target, kvhal_device: Device) -> None:
        """Asked for a dtype, format or layout it did not declare, the hook returns a correct
        cache or raises kvhal's ValidationError."""
        caller = kvhal_target.caller(HOOK)
        problems = []
        for what, geometry, layout in self.undeclared_requests(kvhal_target, kvhal_device):
            try:
                cache = caller(geometry=geometry, layout=layout, device=kvhal_device.torch_device)
            except ValidationError:
                continue
            except Exception as exc:
                problems.append(
                    f"{what}: raised {type(exc).__name__}: {exc}; expected "
                    "kvhal.errors.ValidationError naming the argument"
                )
                continue
            problems += [f"{what}: {p}" for p in _mismatches(cache, geometry, layout, kvhal_device)]
        expect(
            not problems, "alloc.refuses", lambda: f"{HOOK} of {kvhal_target.label}: " + "; ".join(problems)
        )
