"""Fixtures of the suite's tests (registered by :mod:`kvhal_conformance.plugin`)."""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from kvhal.cache import KVCache
from kvhal.device import Device
from kvhal.geometry import KVGeometry
from kvhal.layouts import KVLayout
from kvhal_conformance import guarded
from kvhal_conformance.plugin import state_of
from kvhal_conformance.settings import Settings, Sizes
from kvhal_conformance.target import Target
from kvhal_conformance.timing import Busy


@pytest.fixture(scope="session")
def kvhal_settings(pytestconfig: pytest.Config) -> Settings:
    return state_of(pytestconfig).settings


@pytest.fixture(scope="session")
def kvhal_sizes(kvhal_settings: Settings) -> Sizes:
    return kvhal_settings.sizes


@pytest.fixture(scope="session")
def kvhal_target(pytestconfig: pytest.Config) -> Target:
    return state_of(pytestconfig).target()


@pytest.fixture(scope="session")
def kvhal_device(kvhal_target: Target) -> Device:
    return kvhal_target.require_device()


@pytest.fixture
def kvhal_seed(kvhal_settings: Settings, request: pytest.FixtureRequest) -> int:
    """A seed per test: the run's seed mixed with the test's id (reproducible with --kvhal-seed)."""
    return (kvhal_settings.seed ^ zlib.crc32(request.node.nodeid.encode())) & 0x7FFFFFFF


@pytest.fixture
def kvhal_rng(kvhal_seed: int) -> np.random.Generator:
    return np.random.default_rng(kvhal_seed)


@pytest.fixture(scope="session")
def kvhal_busy(kvhal_device: Device, kvhal_sizes: Sizes) -> Iterator[Busy]:
    """Scratch caches that keep a stream busy for a measured minimum time."""
    busy = Busy(kvhal_device, kvhal_device.kv_layouts()[0], kvhal_sizes.scratch_bytes)
    yield busy
    guarded.free_cache(kvhal_device, busy.dst)


@pytest.fixture
def kvhal_host_cache(kvhal_device: Device) -> Iterator[Callable[[KVGeometry, KVLayout, int], KVCache]]:
    """Make host caches through the plugin's host buffers; they are freed after the test."""
    made: list[KVCache] = []

    def make(geometry: KVGeometry, layout: KVLayout, num_blocks: int) -> KVCache:
        cache = guarded.host_cache(kvhal_device, geometry, layout, num_blocks)
        made.append(cache)
        return cache

    yield make
    for cache in made:
        guarded.free_cache(kvhal_device, cache)
