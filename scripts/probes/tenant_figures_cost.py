"""What the per-tenant counters (issue 38, item 3) cost the scheduler's thread per request.

The work they add: one dict lookup of the request's ``cache_salt`` when the scheduler side
first tracks it (a BLAKE2b only for a salt's first request), and one counter addition at its
allocation (``tenant_lookup_tokens``), one more for a hit and one per store that ends. Measured
two ways in the thread's CPU time (a shared machine's other work does not count), best of 15
runs each, the two settings interleaved:

- that work alone, per request (label, lookup, hit and store counters);
- the scheduler side's whole per-request path for a miss (``track``, ``lookup``,
  ``after_alloc``) over a host tier of 256 blocks, on 4,096 salted requests of 16 tenants
  (three blocks each), with ``tenant_labels`` 16 against 0 (off).

    PYTHONPATH=. .venv/bin/python scripts/probes/tenant_figures_cost.py
"""

from __future__ import annotations

import dataclasses
import time

from vllm import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.request import Request

from kvhal.vllm.scheduler_side import SchedulerSide
from kvhal.vllm.stats import KVHALStats
from kvhal.vllm.tenants import TenantLabels
from tests.test_scheduler_side import HASHER, scheduler_config

REQUESTS, TENANTS, RUNS = 4096, 16, 15
NO_BLOCKS = KVCacheBlocks(([],))


def requests() -> list[Request]:
    salts = [f"salt-{t:02d}-k3J9xQ2mVb7Zr1Lw5Np8Ty4Hc6Gd0Fs" for t in range(TENANTS)]
    return [
        Request(
            f"r{i}",
            [i, i + 1, i + 2] * 4,
            SamplingParams(max_tokens=1),
            None,
            block_hasher=HASHER,
            cache_salt=salts[i % TENANTS],
        )
        for i in range(REQUESTS)
    ]


def per_request_path(side: SchedulerSide, batch: list[Request]) -> float:
    """Seconds per request of a miss's scheduler-side calls."""
    start = time.thread_time()
    for req in batch:
        side.lookup(req, 0)
        side.after_alloc(req, NO_BLOCKS, 0)
    elapsed = time.thread_time() - start
    side._requests.clear()  # as request_finished would, without touching the host tier
    side.stats.reset()
    return elapsed / len(batch)


def tenant_work(batch: list[Request]) -> float:
    """Seconds per request of the tenant counters' own work."""
    labels, stats = TenantLabels(TENANTS), KVHALStats()
    start = time.thread_time()
    for req in batch:
        label = labels.label(req.cache_salt)
        if label is not None:
            stats.add_tenant("tenant_lookup_tokens", label, 12)
            stats.add_tenant("tenant_hit_tokens", label, 8)
            stats.add_tenant("tenant_stored_bytes", label, 3 * 4096)
    return (time.thread_time() - start) / len(batch)


def main() -> None:
    batch = requests()
    base = scheduler_config(slots=256)
    sides = {n: SchedulerSide(dataclasses.replace(base, tenant_labels=n)) for n in (0, TENANTS)}
    best = {n: float("inf") for n in sides}
    for _ in range(RUNS):
        for n, side in sides.items():
            best[n] = min(best[n], per_request_path(side, batch))
    alone = min(tenant_work(batch) for _ in range(RUNS))
    off, on = best[0] * 1e6, best[TENANTS] * 1e6
    print(f"tenant counters' own work: {alone * 1e6:.3f} us per request")
    print(f"a miss's scheduler-side path, tenant_labels=0:  {off:.2f} us per request")
    print(f"a miss's scheduler-side path, tenant_labels={TENANTS}: {on:.2f} us per request")
    print(f"difference: {on - off:+.2f} us ({(on - off) / off:+.1%})")


if __name__ == "__main__":
    main()
