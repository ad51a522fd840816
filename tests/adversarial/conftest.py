"""Fixtures of the adversarial store tests: a host tier of random slots for a remote tier."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from kvhal.offload.host_tier import HostTier
from tests.test_remote_tier import SLOT, SLOTS


@pytest.fixture
def host(cpu) -> Iterator[HostTier]:
    """The CPU plugin's host tier, ``SLOTS`` slots of ``SLOT`` random bytes."""
    tier = HostTier(cpu, SLOT * SLOTS, SLOT)
    rows = np.frombuffer(tier.memory(), dtype=np.uint8)[: SLOT * SLOTS].reshape(SLOTS, SLOT)
    rows[:] = np.random.default_rng(1).integers(0, 256, rows.shape, dtype=np.uint8)
    yield tier
    tier.close()
