"""What a returning chat user's lookup and read cost on a local SeaweedFS, through kvhal's
S3Store: ``exist`` of every one of its blocks' names (a ``HEAD`` each) against a few, and the
range ``GET`` of all of them at several ``max_requests`` (BENCHMARKS.md, "S3 as the shared
store"). Blocks of the chat bench's model: 192 KiB of KV and the 96-byte header.

    .venv/bin/python scripts/probes/s3_lookup_cost.py [--blocks 64] [--repeats 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

from kvhal.testing.seaweedfs_servers import SeaweedS3
from kvhal.tiers.stores.s3 import S3Store

VALUE = 192 * 1024 + 96


def timed(call: Callable[[], object], repeats: int) -> str:
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - start)
    return f"median {1000 * statistics.median(seconds):.1f} ms, min {1000 * min(seconds):.1f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    n = args.blocks
    with SeaweedS3() as s3:
        os.environ.update(s3.credentials)
        stores = {m: S3Store.from_url(s3.url(prefix="probe", max_requests=m)) for m in (2, 8, 32)}
        store = stores[32]
        names = [f"kvhal/v2/probe/{i:040x}" for i in range(n)]
        store.put(names, [[memoryview(os.urandom(VALUE))] for _ in range(n)])
        print(f"exist, all {n} names: {timed(lambda: store.exist(names), args.repeats)}")
        print(f"exist, 8 names: {timed(lambda: store.exist(names[:8]), args.repeats)}")
        print(f"exist, 1 name: {timed(lambda: store.exist(names[:1]), args.repeats)}")
        buffers = [[memoryview(bytearray(VALUE))] for _ in range(n)]
        for m, each in stores.items():
            took = timed(lambda s=each: s.get(names, buffers), args.repeats)
            print(f"get of {n}, max_requests {m}: {took}")
        before = os.times()
        for _ in range(args.repeats):
            store.get(names, buffers)
        after = os.times()
        cpu = (after.user + after.system - before.user - before.system) / args.repeats
        print(f"client CPU per get of {n}: {1000 * cpu:.1f} ms")
        for each in stores.values():
            each.close()


if __name__ == "__main__":
    main()
