"""Contract: block copies (``kvhal_copy_blocks``), checked byte for byte.

Source and destination are filled with a different pattern in every block;
after the copy, every mapped destination block must hold its source block,
every other destination block its old contents, and the source must be
unchanged.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from kvhal.cache import KVCache
from kvhal.device import Device
from kvhal.geometry import KVFormat, KVGeometry
from kvhal.layouts import KVLayout
from kvhal_conformance import blockdata
from kvhal_conformance.cases import (
    DTYPES,
    LAYOUT_KINDS,
    describe,
    layout_of_kind,
    offered_layouts,
    require_dtype,
    require_format,
    small_geometry,
)
from kvhal_conformance.copycheck import copy_problems
from kvhal_conformance.settings import Sizes
from kvhal_conformance.target import Target
from kvhal_conformance.timing import wait

HostCache = Callable[[KVGeometry, KVLayout, int], KVCache]
DIRECTIONS = ("d2h", "h2d")
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


def copy_and_check(
    device: Device,
    host_cache: HostCache,
    geometry: KVGeometry,
    layout: KVLayout,
    direction: str,
    mapping: np.ndarray,
    seed: int,
    what: str,
    host_blocks: int = HOST_BLOCKS,
) -> None:
    """Copy ``mapping`` between a fresh device cache and a host cache; check every byte."""
    on_device = device.allocate_kv_cache(geometry, layout)
    on_host = host_cache(geometry, layout, host_blocks)
    src, dst = (on_device, on_host) if direction == "d2h" else (on_host, on_device)
    src_before, dst_before = blockdata.fill(src, seed), blockdata.fill(dst, seed + 1)
    context = f"kvhal_copy_blocks ({direction}, {describe(layout, geometry)}, {what})"
    event = device.copy_blocks(src, dst, mapping)
    wait(device, event, context)
    assert device.query_event(event), (
        f"{context}: kvhal_query_event reports a synchronized copy's event incomplete"
    )
    problems = copy_problems(mapping, src_before, blockdata.read(src), dst_before, blockdata.read(dst))
    assert not problems, f"{context}: " + "; ".join(problems) + ". " + blockdata.mapping_preview(mapping)


def _sides(direction: str) -> tuple[int, int]:
    return (DEVICE_BLOCKS, HOST_BLOCKS) if direction == "d2h" else (HOST_BLOCKS, DEVICE_BLOCKS)


@pytest.mark.parametrize("layout_kind", LAYOUT_KINDS)
@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("kind", MAPPINGS)
def test_mapping(
    kvhal_target: Target,
    kvhal_device: Device,
    kvhal_host_cache: HostCache,
    kvhal_rng: np.random.Generator,
    kvhal_seed: int,
    kind: str,
    direction: str,
    layout_kind: str,
) -> None:
    """Random, empty, one-block, last-block, non-contiguous, coalescable and fan-out mappings copy exactly."""
    layout = layout_of_kind(kvhal_target, kvhal_device, layout_kind)
    mapping = make_mapping(kind, kvhal_rng, *_sides(direction))
    copy_and_check(
        kvhal_device,
        kvhal_host_cache,
        small_geometry(),
        layout,
        direction,
        mapping,
        kvhal_seed,
        f"mapping '{kind}'",
    )


@pytest.mark.parametrize("layout_kind", LAYOUT_KINDS)
@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_dtype(
    kvhal_target: Target,
    kvhal_device: Device,
    kvhal_host_cache: HostCache,
    kvhal_rng: np.random.Generator,
    kvhal_seed: int,
    dtype: str,
    direction: str,
    layout_kind: str,
) -> None:
    """bf16, fp16, fp32 (required) and fp8 (when declared) caches copy bit for bit."""
    require_dtype(kvhal_target, DTYPES[dtype])
    layout = layout_of_kind(kvhal_target, kvhal_device, layout_kind)
    mapping = make_mapping("random", kvhal_rng, *_sides(direction))
    geometry = small_geometry(DTYPES[dtype])
    copy_and_check(
        kvhal_device, kvhal_host_cache, geometry, layout, direction, mapping, kvhal_seed, "random mapping"
    )


@pytest.mark.parametrize("layout_kind", LAYOUT_KINDS)
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_split_kv(
    kvhal_target: Target,
    kvhal_device: Device,
    kvhal_host_cache: HostCache,
    kvhal_rng: np.random.Generator,
    kvhal_seed: int,
    direction: str,
    layout_kind: str,
) -> None:
    """Caches kept as a (K, V) pair per layer copy both parts (when kv.split is declared)."""
    require_format(kvhal_target, KVFormat.SPLIT)
    layout = layout_of_kind(kvhal_target, kvhal_device, layout_kind)
    mapping = make_mapping("random", kvhal_rng, *_sides(direction))
    geometry = small_geometry(kv_format=KVFormat.SPLIT)
    copy_and_check(
        kvhal_device, kvhal_host_cache, geometry, layout, direction, mapping, kvhal_seed, "random mapping"
    )


@pytest.mark.parametrize("layout_kind", LAYOUT_KINDS)
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_large_batch(
    kvhal_target: Target,
    kvhal_device: Device,
    kvhal_host_cache: HostCache,
    kvhal_rng: np.random.Generator,
    kvhal_seed: int,
    kvhal_sizes: Sizes,
    direction: str,
    layout_kind: str,
) -> None:
    """Every block of a large cache, scattered on the device side, copies in one batch."""
    layout = layout_of_kind(kvhal_target, kvhal_device, layout_kind)
    n = kvhal_sizes.large_batch
    geometry = KVGeometry(
        num_layers=2, num_blocks=n, block_size=4, num_kv_heads=1, head_size=8, dtype=DTYPES["bf16"]
    )
    scattered, packed = kvhal_rng.permutation(n), np.arange(n)
    pairs = (scattered, packed) if direction == "d2h" else (packed, scattered)
    mapping = np.stack(pairs, axis=1).astype(np.int64)
    copy_and_check(
        kvhal_device,
        kvhal_host_cache,
        geometry,
        layout,
        direction,
        mapping,
        kvhal_seed,
        f"{n} blocks",
        host_blocks=n,
    )


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_every_offered_layout(
    kvhal_target: Target,
    kvhal_device: Device,
    kvhal_host_cache: HostCache,
    kvhal_rng: np.random.Generator,
    kvhal_seed: int,
    direction: str,
) -> None:
    """A random mapping copies exactly in every layout kvhal_kv_layouts(None) offers."""
    for layout in offered_layouts(kvhal_target, kvhal_device):
        mapping = make_mapping("random", kvhal_rng, *_sides(direction))
        copy_and_check(
            kvhal_device,
            kvhal_host_cache,
            small_geometry(),
            layout,
            direction,
            mapping,
            kvhal_seed,
            "random mapping",
        )
