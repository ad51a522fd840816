"""Where a small kvhal copy's time goes, step by step: 16 cross-layer blocks of 4 KiB x 16
layers (1 MiB), the smallest row of `kvhal bench copy`, beside the same bytes as one
``torch.copy_``. Medians of many calls, in microseconds.

    python plugins/cuda/tools/copy_overhead.py [cuda|cpu]

On the CPU plugin only the steps shared by every plugin are timed (its copies run on a
stream thread of its own); on a GPU plugin built on ``kvhal.accel`` (kvhal-cuda) the
plugin's own steps too.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
import torch

from kvhal.accel.copies import Descriptors, split_at
from kvhal.accel.engines import CopyJob
from kvhal.accel.host_writes import source_may_be_read_early
from kvhal.bench.copy import Case, PlainCopy, geometry_for
from kvhal.copyplan import plan_copy
from kvhal.layouts import BLHNC
from kvhal.registry import select_device


def median_us(fn: Callable[[], object], n: int = 1000) -> float:
    for _ in range(50):
        fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> None:
    device = select_device(sys.argv[1] if len(sys.argv) > 1 else None)
    geometry = geometry_for(4096, 16, 24)
    cross = Case(device, geometry, BLHNC, 16, np.random.default_rng(0))
    plain = PlainCopy(device, 16 * geometry.block_bytes)
    plan = device.plan_copy(cross.cache, cross.host, cross.store)
    rows = {
        "a whole copy and its synchronize": lambda: cross.run("d2h"),
        "the same bytes, one torch.copy_ (the limit)": lambda: plain.run_torch("d2h"),
        "one descriptor through kvhal": lambda: plain.run_device("d2h"),
        "  plan_copy (validation, descriptors)": lambda: plan_copy(cross.cache, cross.host, cross.store),
        "  Device.plan_copy (and the capability checks)": lambda: device.plan_copy(
            cross.cache, cross.host, cross.store
        ),
        "  order_after_compute (event, record, wait)": lambda: device.order_after_compute(cross.stream),
        "  submit, not ordered": lambda: device.submit(plan, cross.stream, after_compute=False),
    }
    if device.torch_device.type != "cpu":
        hooks = device._pm.get_plugin(device.plugin_name)
        module = hooks.stream_module()
        descriptors = split_at(Descriptors.of(plan), hooks.host_split_points())
        chain = hooks.engine_chain()

        def enter_stream() -> None:
            with module.stream(cross.stream):
                pass

        rows |= {
            "    the hook kvhal_copy_blocks": lambda: hooks.kvhal_copy_blocks(plan=plan, stream=cross.stream),
            "      its copy engine's call": lambda: chain.run(
                CopyJob(plan, descriptors, plan.direction, cross.stream, False)
            ),
            "      entering torch's stream context": enter_stream,
            "      an event and its record": lambda: module.Event().record(cross.stream),
            "      descriptors and splits": lambda: split_at(Descriptors.of(plan), hooks.host_split_points()),
            "      keep-alive": lambda: hooks.keep_alive(plan, cross.stream),
            "      may the source be read early": lambda: source_may_be_read_early(
                plan.direction, descriptors, hooks.host_writes
            ),
        }
    print(f"device {device.name}, torch {torch.__version__}; microseconds, median")
    for name, fn in rows.items():
        print(f"{median_us(fn):9.1f}  {name}")
        device.synchronize_event(device.submit(plan, cross.stream, after_compute=False))


if __name__ == "__main__":
    main()
