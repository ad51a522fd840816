"""What a copy plan costs on the engine's thread with the caches cold, as right after a forward
(BENCHMARKS.md, "The engine thread's share"): a 60-block plan of the chat bench's geometry
checked and planned, its descriptors, and the numpy split between copy threads, warm and
after a 100 MB pass, through kvhal's C planner and through its numpy path.

    .venv/bin/python scripts/probes/cold_copy_plan.py
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from kvhal import copyplan
from kvhal.copyplan import plan_copy
from kvhal.cpu.copy_engine import split_shares
from kvhal.geometry import KVGeometry
from kvhal.layouts import LBHNC
from kvhal.registry import select_device


def main() -> None:
    device = select_device()
    geometry = KVGeometry(
        num_layers=6, num_blocks=600, block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32
    )
    cache = device.allocate_kv_cache(geometry, LBHNC)
    host = device.allocate_host_cache(geometry, LBHNC, 600)
    sweep = np.ones(100 << 20, np.uint8)
    mapping = np.stack([np.arange(100, 160), np.arange(300, 360)], axis=1)
    native = copyplan.native
    for path in ("C", "numpy"):
        copyplan.native = native if path == "C" else None
        for cold in (False, True):
            plans, descriptors, splits = [], [], []
            for _ in range(40):
                if cold:
                    sweep.sum()
                if path == "numpy":  # the numpy path checked the cache pair every plan
                    host.__dict__.pop("_kvhal_paired", None)
                start = time.perf_counter()
                plan = plan_copy(host, cache, mapping)
                plans.append(time.perf_counter() - start)
                if cold:
                    sweep.sum()
                start = time.perf_counter()
                triple = plan.descriptors
                descriptors.append(time.perf_counter() - start)
                if cold:
                    sweep.sum()
                start = time.perf_counter()
                split_shares(*triple, 2)
                splits.append(time.perf_counter() - start)
            us = [1e6 * statistics.median(t) for t in (plans, descriptors, splits)]
            state = "cold" if cold else "warm"
            print(f"{path:5} {state}: plan {us[0]:.0f} us, descriptors {us[1]:.0f} us, split {us[2]:.0f} us")
    copyplan.native = native
    device.free_host_cache(host)


if __name__ == "__main__":
    main()
