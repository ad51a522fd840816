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
from kvhal_conformance import blockdata
from kvhal_conformance.cases import (
    DTYPES,
    FORMATS,
    describe,
    distinct_geometry,
    offered_layouts,
    require_dtype,
    require_format,
)
from kvhal_conformance.target import Target

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


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_allocates_what_was_asked(kvhal_target: Target, kvhal_device: Device, dtype: str, fmt: str) -> None:
    """For every offered layout, the cache has the geometry, dtype, layout and device asked for."""
    require_dtype(kvhal_target, DTYPES[dtype])
    require_format(kvhal_target, FORMATS[fmt])
    geometry = distinct_geometry(FORMATS[fmt], DTYPES[dtype])
    for layout in offered_layouts(kvhal_target, kvhal_device):
        cache = kvhal_target.call(HOOK, geometry=geometry, layout=layout, device=kvhal_device.torch_device)
        problems = _mismatches(cache, geometry, layout, kvhal_device)
        assert not problems, f"{HOOK} ({describe(layout, geometry)}): " + "; ".join(problems)
        kvhal_device.allocate_kv_cache(geometry, layout)  # kvhal's own checks agree


@pytest.mark.parametrize("fmt", FORMATS)
def test_cache_is_zeroed_and_unaliased(kvhal_target: Target, kvhal_device: Device, fmt: str) -> None:
    """For every offered layout, a new cache is all zero bytes and every element has its own memory."""
    require_format(kvhal_target, FORMATS[fmt])
    geometry = distinct_geometry(FORMATS[fmt])
    for layout in offered_layouts(kvhal_target, kvhal_device):
        cache = kvhal_device.allocate_kv_cache(geometry, layout)
        where = f"{HOOK} ({describe(layout, geometry)})"
        nonzero = sum(int(part.count_nonzero()) for part in blockdata.read(cache))
        assert nonzero == 0, f"{where}: a new cache must be zeroed; {nonzero} elements are not zero"
        written = blockdata.fill(cache, seed=len(layout.name))
        same = blockdata.blocks_equal(blockdata.read(cache), written)
        assert bool(same.all()), (
            f"{where}: after writing a distinct value to every element, blocks "
            f"{blockdata.id_list(torch.nonzero(~same).flatten().tolist())} read back different values: "
            "views share memory"
        )


def _undeclared_requests(target: Target, device: Device) -> list[tuple[str, KVGeometry, KVLayout]]:
    """Allocations the plugin has not said it can hold: each may be refused."""
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


def test_refuses_what_it_cannot_hold(kvhal_target: Target, kvhal_device: Device) -> None:
    """Asked for a dtype, format or layout it did not declare, the hook returns a correct
    cache or raises kvhal's ValidationError."""
    caller = kvhal_target.caller(HOOK)
    problems = []
    for what, geometry, layout in _undeclared_requests(kvhal_target, kvhal_device):
        try:
            cache = caller(geometry=geometry, layout=layout, device=kvhal_device.torch_device)
        except ValidationError:
            continue
        except Exception as exc:
            problems.append(
                f"{what}: raised {type(exc).__name__}: {exc}; expected kvhal.errors.ValidationError "
                "naming the argument"
            )
            continue
        problems += [f"{what}: {p}" for p in _mismatches(cache, geometry, layout, kvhal_device)]
    assert not problems, f"{HOOK} of {kvhal_target.label}: " + "; ".join(problems)
