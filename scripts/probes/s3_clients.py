"""Which S3 client for kvhal's object-store tier: the same workload through obstore and boto3,
alone and beside a thread that runs Python without pause (as an engine's loop holds the GIL).

The workload (as ``kvhal.bench.shared.gil`` for Redis): VALUES puts of KIB KiB, then VALUES
range GETs of the same objects into a preallocated buffer (size + 1 bytes asked, as kvhal
reads), in batches of 8 and 32 requests at once, against a local SeaweedFS
(:mod:`kvhal.testing.seaweedfs_servers`). Clients:

- obstore, async: a batch is one ``asyncio.gather`` of ``put_async`` / ``get_range_async`` on
  one event-loop thread (the requests run in obstore's Rust runtime);
- obstore, sync on threads: a thread per request of a batch, each calling ``obstore.put`` /
  ``obstore.get_range`` (which wait in Rust);
- kvhal's S3Store (``max_requests`` the batch), which does what the first does;
- boto3 on threads: a thread per request of a batch, each calling ``put_object`` /
  ``get_object(Range=...)`` and reading the body (one client, thread-safe, its pool sized to
  the batch).

Per client and batch size: the median seconds of the 64 puts and of the 64 GETs alone and
beside the busy thread, the process's CPU seconds (alone), and how much of its Python the busy
thread lost while the client ran (its loop count beside the client against alone, over the
same wall time): what the client takes from an engine thread. Prints a table; ``--out DIR``
writes ``s3_clients.json``. Needs boto3 (``pip install boto3``; kvhal itself does not).

    .venv/bin/python scripts/probes/s3_clients.py [--values 64] [--kib 256] [--repeats 7]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import obstore

from kvhal.testing.seaweedfs_servers import ACCESS_KEY, REGION, SECRET_KEY, SeaweedS3


class Spinner:
    """A thread running Python without pause; :meth:`loops` counts its loops so far."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.count = [0]
        self.thread = threading.Thread(target=self._spin)

    def _spin(self) -> None:
        count, stop = self.count, self.stop
        while not stop.is_set():
            count[0] += 1

    def loops(self) -> int:
        return self.count[0]

    def __enter__(self) -> Spinner:
        self.thread.start()
        time.sleep(0.01)  # running before the client starts
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


class ObstoreAsync:
    name = "obstore, async (one event loop)"

    def __init__(self, s3: SeaweedS3, batch: int) -> None:
        self.store = s3.objects()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def _run(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(60)

    def put(self, names: list[str], values: list[memoryview]) -> None:
        async def batch() -> None:
            await asyncio.gather(
                *(obstore.put_async(self.store, n, v) for n, v in zip(names, values, strict=True))
            )

        self._run(batch())

    def get(self, names: list[str], buffers: list[memoryview]) -> None:
        async def batch() -> list[Any]:
            size = len(buffers[0])
            return await asyncio.gather(
                *(obstore.get_range_async(self.store, n, start=0, length=size + 1) for n in names)
            )

        for data, buffer in zip(self._run(batch()), buffers, strict=True):
            buffer[: len(data)] = memoryview(data)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()


class ObstoreThreads:
    name = "obstore, sync on threads"

    def __init__(self, s3: SeaweedS3, batch: int) -> None:
        self.store = s3.objects()
        self.pool = ThreadPoolExecutor(batch)

    def put(self, names: list[str], values: list[memoryview]) -> None:
        list(self.pool.map(lambda nv: obstore.put(self.store, nv[0], nv[1]), zip(names, values, strict=True)))

    def get(self, names: list[str], buffers: list[memoryview]) -> None:
        def one(nb: tuple[str, memoryview]) -> None:
            data = obstore.get_range(self.store, nb[0], start=0, length=len(nb[1]) + 1)
            nb[1][: len(data)] = memoryview(data)

        list(self.pool.map(one, zip(names, buffers, strict=True)))

    def close(self) -> None:
        self.pool.shutdown()


class KvhalS3Store:
    name = "kvhal S3Store (obstore, async)"

    def __init__(self, s3: SeaweedS3, batch: int) -> None:
        import os

        from kvhal.registry import PluginRegistry
        from kvhal.tiers.media import open_store

        os.environ.update(s3.credentials)
        self.store = open_store(s3.url(max_requests=batch), PluginRegistry())

    def put(self, names: list[str], values: list[memoryview]) -> None:
        assert all(self.store.put(names, [[v] for v in values]))

    def get(self, names: list[str], buffers: list[memoryview]) -> None:
        self.store.get(names, [[b] for b in buffers])

    def close(self) -> None:
        self.store.close()


class Boto3Threads:
    name = "boto3, on threads"

    def __init__(self, s3: SeaweedS3, batch: int) -> None:
        import boto3
        from botocore.config import Config

        self.client = boto3.client(
            "s3",
            endpoint_url=s3.endpoint,
            region_name=REGION,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            config=Config(max_pool_connections=batch, s3={"addressing_style": "path"}),
        )
        self.bucket = s3.buckets[0]
        self.pool = ThreadPoolExecutor(batch)

    def put(self, names: list[str], values: list[memoryview]) -> None:
        def one(nv: tuple[str, memoryview]) -> None:
            self.client.put_object(Bucket=self.bucket, Key=nv[0], Body=bytes(nv[1]))

        list(self.pool.map(one, zip(names, values, strict=True)))

    def get(self, names: list[str], buffers: list[memoryview]) -> None:
        def one(nb: tuple[str, memoryview]) -> None:
            answer = self.client.get_object(Bucket=self.bucket, Key=nb[0], Range=f"bytes=0-{len(nb[1])}")
            data = answer["Body"].read()
            nb[1][: len(data)] = memoryview(data)

        list(self.pool.map(one, zip(names, buffers, strict=True)))

    def close(self) -> None:
        self.pool.shutdown()


def measure(run: Callable[[], None], repeats: int, after: Callable[[], None]) -> dict[str, float]:
    """``run``'s medians; ``after`` runs after each (untimed: the objects a put made removed)."""
    alone, beside, cpu, lost = [], [], [], []
    for _ in range(repeats):
        start, cpu_start = time.perf_counter(), time.process_time()
        run()
        alone.append(time.perf_counter() - start)
        cpu.append(time.process_time() - cpu_start)
        after()
        with Spinner() as spinner:
            first, start = spinner.loops(), time.perf_counter()
            run()
            took, during = time.perf_counter() - start, spinner.loops() - first
            # the same spinner alone for as long, just after: its rate without the client
            first, start = spinner.loops(), time.perf_counter()
            time.sleep(took)
            rate = (spinner.loops() - first) / (time.perf_counter() - start)
        after()
        beside.append(took)
        lost.append(max(0.0, 1.0 - during / (rate * took)))
    return {
        "alone_s": statistics.median(alone),
        "beside_busy_thread_s": statistics.median(beside),
        "cpu_s": statistics.median(cpu),
        "busy_thread_lost": statistics.median(lost),
    }


def run_client(
    client: Any, batch: int, values: list[memoryview], buffers: list[memoryview], repeats: int, objects: Any
) -> list[dict[str, Any]]:
    """The puts' and the GETs' rows of ``client`` at ``batch`` requests at once (``objects``:
    an obstore client that removes what each run of puts made, so the server never fills)."""
    runs = iter(range(10**9))
    made: list[str] = []
    count = len(values)
    tag = f"{time.monotonic_ns()}"  # names of this client's own: a create never meets another's

    def puts() -> None:
        run = next(runs)  # fresh names each time
        for first in range(0, count, batch):
            names = [f"probe/{tag}/{run}/{i}" for i in range(first, min(first + batch, count))]
            client.put(names, values[first : first + batch])
            if run:
                made.extend(names)

    def remove() -> None:
        if made:
            obstore.delete(objects, made)
            made.clear()

    def gets() -> None:
        for first in range(0, count, batch):
            names = [f"probe/{tag}/0/{i}" for i in range(first, min(first + batch, count))]
            client.get(names, buffers[first : first + batch])

    puts()  # connect, warm up; run 0 is what the GETs read
    gets()
    assert all(bytes(b) == bytes(v) for b, v in zip(buffers, values, strict=True)), client.name
    return [
        {"client": client.name, "batch": batch, "op": op, **measure(run, repeats, remove)}
        for op, run in (("put", puts), ("get", gets))
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--values", type=int, default=64)
    parser.add_argument("--kib", type=int, default=256)
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    size = args.kib << 10
    source = bytearray(time.time_ns().to_bytes(8, "little") * (args.values * size // 8))
    values = [memoryview(source)[i * size : (i + 1) * size] for i in range(args.values)]
    target = bytearray(args.values * (size + 1))
    buffers = [memoryview(target)[i * (size + 1) : (i + 1) * (size + 1) - 1] for i in range(args.values)]
    rows = []
    with SeaweedS3() as s3:
        for client_class in (ObstoreAsync, ObstoreThreads, KvhalS3Store, Boto3Threads):
            for batch in args.batches:
                client = client_class(s3, batch)
                rows += run_client(client, batch, values, buffers, args.repeats, s3.objects())
                client.close()
    mb = args.values * size / 1e6
    print(f"{args.values} values of {args.kib} KiB ({mb:.1f} MB) per run, median of {args.repeats} runs")
    header = f"{'client':31} {'batch':>5} {'op':>4} {'alone s':>8} {'busy s':>8} {'ratio':>6} {'MB/s':>7}"
    print(f"{header} {'CPU s':>7} {'busy thread lost':>17}")
    for r in rows:
        ratio = r["beside_busy_thread_s"] / r["alone_s"]
        times = f"{r['alone_s']:8.4f} {r['beside_busy_thread_s']:8.4f} {ratio:6.2f}"
        print(
            f"{r['client']:31} {r['batch']:5d} {r['op']:>4} {times} {mb / r['alone_s']:7.0f} "
            f"{r['cpu_s']:7.4f} {r['busy_thread_lost']:16.0%}"
        )
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        result = {"values": args.values, "value_bytes": size, "repeats": args.repeats, "rows": rows}
        (args.out / "s3_clients.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
