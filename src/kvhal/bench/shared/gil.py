"""Redis reads and writes beside a busy thread: what the engine's GIL costs store I/O.

``python -m kvhal.bench.shared.gil [--out DIR]``. A returning user's blocks (60 values of
192 KiB, by default) are read by kvhal's ``RedisStore.get`` on a thread of their own, alone
and beside a thread that runs Python without pause (as an engine's loop holds the GIL between
its steps), through each reader side by side: kvhal's own reader (values received into the
buffers, the default where built), valkey-glide and redis-py with hiredis; then the same
values written (``SET NX`` under fresh names) through glide and redis-py. Beside the times,
the CPU seconds of the whole process per call (alone: every thread's, the clients' own
included). The limit beside them: the same bytes as one ``memcpy``. Prints a table and writes
``gil.json``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path

from kvhal.testing.redis_servers import RedisServer
from kvhal.tiers.stores.redis import RedisStore


def _busy(stop: threading.Event) -> None:
    spins = 0
    while not stop.is_set():
        spins += 1


def _cpu(read: Callable[[], object], repeats: int) -> float:
    """The median CPU seconds of this process (every thread) per call of ``read``, alone."""
    times = []
    for _ in range(repeats):
        start = time.process_time()
        read()
        times.append(time.process_time() - start)
    return statistics.median(times)


def _timed(read: Callable[[], object], contended: bool, repeats: int) -> float:
    """The median seconds of ``read`` on its own thread, beside a busy one if ``contended``."""
    times = []
    for _ in range(repeats):
        stop = threading.Event()
        spinner = threading.Thread(target=_busy, args=(stop,)) if contended else None
        if spinner is not None:
            spinner.start()
        took: list[float] = []

        def run(took: list[float] = took) -> None:
            start = time.perf_counter()
            read()
            took.append(time.perf_counter() - start)

        reader = threading.Thread(target=run)
        reader.start()
        reader.join()
        stop.set()
        if spinner is not None:
            spinner.join()
        times.append(took[0])
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvhal.bench.shared.gil", description=__doc__)
    parser.add_argument("--values", type=int, default=60)
    parser.add_argument("--kib", type=int, default=192, help="value size, KiB")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", type=Path, default=None, help="folder for gil.json")
    args = parser.parse_args(argv)
    size = args.kib << 10
    names = [f"gil/{i}" for i in range(args.values)]
    rows = []
    with RedisServer() as server:
        client = server.client()
        for name in names:
            client.set(name, os.urandom(size))
        destination = bytearray(args.values * size)
        buffers = [[memoryview(destination)[i * size : (i + 1) * size]] for i in range(args.values)]
        source = bytes(destination)
        readers: dict[str, Callable[[], object]] = {}
        direct, glide, plain = (RedisStore.from_url(server.url, r) for r in ("direct", "glide", "redis-py"))
        if direct._direct is not None:
            readers["kvhal RedisStore, kvhal's reader"] = lambda: direct.get(names, buffers)
        if glide._glide is not None:
            readers["kvhal RedisStore, valkey-glide reads"] = lambda: glide.get(names, buffers)
        readers["kvhal RedisStore, redis-py + hiredis reads"] = lambda: plain.get(names, buffers)
        readers["limit: memcpy of the same bytes"] = lambda: destination.__setitem__(slice(None), source)
        values = [[memoryview(source)[i * size : (i + 1) * size]] for i in range(args.values)]
        written = itertools.count()

        def writes(store: RedisStore) -> Callable[[], object]:
            def write() -> object:  # fresh names each time: SET NX of an existing name is a no-op
                run = next(written)
                return store.put([f"gil/w{run}/{i}" for i in range(args.values)], values)

            return write

        if glide._glide is not None:
            readers["kvhal RedisStore, valkey-glide writes"] = writes(glide)
        readers["kvhal RedisStore, redis-py + hiredis writes"] = writes(plain)
        for label, read in readers.items():
            read()  # connect, warm up
            alone = _timed(read, False, args.repeats)
            busy = _timed(read, True, args.repeats)
            cpu = _cpu(read, args.repeats)
            rows.append({"reader": label, "alone_s": alone, "beside_busy_thread_s": busy, "cpu_s": cpu})
        for store in (direct, glide, plain):
            store.close()
    megabytes = args.values * size / 1e6
    print(f"{args.values} values of {args.kib} KiB ({megabytes:.1f} MB), median of {args.repeats} calls, s")
    print(f"{'reader':44} {'alone':>8} {'beside a busy thread':>22} {'ratio':>7} {'CPU s, alone':>13}")
    for row in rows:
        ratio = row["beside_busy_thread_s"] / row["alone_s"]
        print(
            f"{row['reader']:44} {row['alone_s']:8.4f} {row['beside_busy_thread_s']:22.4f} {ratio:7.1f} "
            f"{row['cpu_s']:13.4f}"
        )
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        result = {"values": args.values, "value_bytes": size, "repeats": args.repeats, "rows": rows}
        (args.out / "gil.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
