"""Contract: block copies (``kvhal_copy_blocks``), checked byte for byte.

Source and destination are filled with a different pattern in every block;
after the copy, every mapped destination block must hold its source block,
every other destination block its old contents, and the source must be
unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

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
        on_device = device.allocate_kv_cache(geometry, layout)
        on_host = self.host_cache(geometry, layout, host_blocks)
        src, dst = (on_device, on_host) if direction == "d2h" else (on_host, on_device)
        src_before, dst_before = blockdata.fill(src, self.seed), blockdata.fill(dst, self.seed + 1)
        context = f"kvhal_copy_blocks ({direction}, {describe(layout, geometry)}, {what})"
        event = device.copy_blocks(src, dst, mapping)
        wait(device, event, context)
        assert device.query_event(event), (
            f"{context}: kvhal_query_event reports a synchronized copy incomplete"
        )
        problems = copy_problems(mapping, src_before, blockdata.read(src), dst_before, blockdata.read(dst))
        assert not problems, f"{context}: " + "; ".join(problems) + ". " + blockdata.mapping_preview(mapping)


@pytest.fixture
def copier(
    kvhal_target: Target,
    kvhal_device: Device,
    kvhal_host_cache: HostCache,
    kvhal_rng: np.random.Generator,
    kvhal_seed: int,
) -> Copier:
    return Copier(kvhal_target, kvhal_device, kvhal_host_cache, kvhal_rng, kvhal_seed)


@pytest.mark.parametrize("layout_kind", LAYOUT_KINDS)
@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("kind", MAPPINGS)
def test_mapping(copier: Copier, kind: str, direction: str, layout_kind: str) -> None:
    """Random, empty, one-block, last-block, non-contiguous, coalescable and fan-out mappings copy exactly."""
    layout = copier.layout(layout_kind)
    copier.check(small_geometry(), layout, direction, copier.mapping(kind, direction), f"mapping '{kind}'")


@pytest.mark.parametrize("layout_kind", LAYOUT_KINDS)
@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_dtype(copier: Copier, dtype: str, direction: str, layout_kind: str) -> None:
    """bf16, fp16, fp32 (required) and fp8 (when declared) caches copy bit for bit."""
    require_dtype(copier.target, DTYPES[dtype])
    layout = copier.layout(layout_kind)
    geometry = small_geometry(DTYPES[dtype])
    copier.check(geometry, layout, direction, copier.mapping("random", direction), "random mapping")


@pytest.mark.parametrize("layout_kind", LAYOUT_KINDS)
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_split_kv(copier: Copier, direction: str, layout_kind: str) -> None:
    """Caches kept as a (K, V) pair per layer copy both parts (when kv.split is declared)."""
    require_format(copier.target, KVFormat.SPLIT)
    layout = copier.layout(layout_kind)
    geometry = small_geometry(kv_format=KVFormat.SPLIT)
    copier.check(geometry, layout, direction, copier.mapping("random", direction), "random mapping")


@pytest.mark.parametrize("layout_kind", LAYOUT_KINDS)
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_large_batch(copier: Copier, kvhal_sizes: Sizes, direction: str, layout_kind: str) -> None:
    """Every block of a large cache, scattered on the device side, copies in one batch."""
    layout = copier.layout(layout_kind)
    n = kvhal_sizes.large_batch
    geometry = small_geometry(num_blocks=n, num_layers=2)
    scattered, packed = copier.rng.permutation(n), np.arange(n)
    pairs = (scattered, packed) if direction == "d2h" else (packed, scattered)
    copier.check(geometry, layout, direction, np.stack(pairs, axis=1), f"{n} blocks", host_blocks=n)


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_every_offered_layout(copier: Copier, direction: str) -> None:
    """A random mapping copies exactly in every layout kvhal_kv_layouts(None) offers."""
    for layout in offered_layouts(copier.target, copier.device):
        copier.check(
            small_geometry(), layout, direction, copier.mapping("random", direction), "random mapping"
        )
