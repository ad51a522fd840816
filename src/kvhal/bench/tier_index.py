"""The recovery speed of the tier index (:class:`~kvhal.tiers.index.TierIndex`).

``kvhal bench manager --recover-blocks N`` and ``kvhal bench disk`` time a warm
restart with :func:`measure_recover`. (``--tier-index clock`` replays the
manager's trace through a tier index: :class:`kvhal.bench.drivers.TierIndexDriver`.)
"""

from __future__ import annotations

import gc
import os
import time

import numpy as np

from kvhal.registry import PluginRegistry
from kvhal.tiers.index import TierIndex


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
