"""The tier index (:class:`~kvhal.tiers.index.TierIndex`) in ``kvhal bench manager``, and its recovery speed.

``kvhal bench manager --tier-index clock`` replays the manager's trace through
a tier index as well (its rows are ``tier-index POLICY``: the same calls, bytes
per tracked block measured the same way); ``--recover-blocks N`` times a warm
restart, :func:`measure_recover`, which ``kvhal bench disk`` can call too.
"""

from __future__ import annotations

import gc
import os
import time

import numpy as np

from kvhal.bench.manager import KvhalDriver
from kvhal.registry import PluginRegistry
from kvhal.tiers.index import TierIndex


class TierIndexDriver(KvhalDriver):
    """The manager's driver over a :class:`TierIndex` (the same API, the same calls)."""

    name = "kvhal TierIndex"

    def __init__(self, num_slots: int, policy: str, registry: PluginRegistry) -> None:
        self.policy = policy
        self.manager = TierIndex(num_slots, policy, registry=registry)  # type: ignore[assignment]


def measure_recover(num_blocks: int, policy: str = "clock", key_bytes: int = 36, repeats: int = 3) -> dict:
    """Seconds and blocks/s of :meth:`TierIndex.recover` of ``num_blocks`` random keys in shuffled
    slots of a full tier (best of ``repeats``; key creation not timed)."""
    rng = np.random.default_rng(0)
    keys = [os.urandom(key_bytes) for _ in range(num_blocks)]
    slots = rng.permutation(num_blocks)
    registry = PluginRegistry()
    best = float("inf")
    for _ in range(repeats):
        index = TierIndex(num_blocks, policy, registry=registry)
        gc.collect()
        start = time.perf_counter()
        index.recover(slots, keys)
        best = min(best, time.perf_counter() - start)
        assert len(index) == num_blocks
        del index
    return {"blocks": num_blocks, "policy": policy, "seconds": best, "blocks_per_s": num_blocks / best}
