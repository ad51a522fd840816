"""What recording kvhal's latency histograms and occupancy gauges (issue 37) costs the engine
thread: the scheduler side's ``_gauges()`` (once per step that sends stats; a host tier of 64
slots with six store jobs in flight, every gauge changed, or none) and one histogram
observation with its ``time.monotonic()`` (once per job). Best of 5 x 20,000 calls.

    PYTHONPATH=. .venv/bin/python scripts/probes/metrics_cost.py
"""

from __future__ import annotations

import time
import timeit

from kvhal.vllm.scheduler_side import SchedulerSide
from kvhal.vllm.stats import KVHALStats
from tests.test_scheduler_side import prefill, request, scheduler_config

N = 20_000


def best_us(fn) -> float:
    return min(timeit.repeat(fn, number=N, repeat=5)) / N * 1e6


def main() -> None:
    side = SchedulerSide(scheduler_config(slots=64))
    for i in range(6):  # six stores in flight
        prefill(
            side, request(f"r{i}", list(range(1000 * i, 1000 * i + 12))), [3 * i + 1, 3 * i + 2, 3 * i + 3]
        )

    def changed() -> None:
        side._gauges_sent.clear()  # the worst case: every gauge set
        side._gauges()
        side.stats.data.clear()

    stats = KVHALStats()

    def observe() -> None:
        stats.observe("tier_write_seconds", "host", time.monotonic() - 1.0)

    print(f"jobs in flight: {sum(1 for _ in side.jobs.pending())}")
    print(f"_gauges(), every gauge changed: {best_us(changed):.2f} us")
    print(f"_gauges(), none changed: {best_us(side._gauges):.2f} us")
    print(f"one observation with its time.monotonic(): {best_us(observe):.3f} us")


if __name__ == "__main__":
    main()
