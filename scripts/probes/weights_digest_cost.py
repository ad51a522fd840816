"""What naming a model by every byte of its weights costs an engine's start (issue 38, item 5).

Writes a model of ``--files`` weight files of ``--gib`` GiB each (random bytes, no hole) under
``--dir``, then times :func:`kvhal.vllm.model_identity.weights_digest`:

- ``read only, from disk``: the files read once, nothing hashed (the disk's pace: the floor);
- ``cold, from disk``: no kept digest, the files dropped from the page cache first
  (``POSIX_FADV_DONTNEED``, after ``fsync``);
- ``cold, page cache``: no kept digest, the files in the page cache (as right after vLLM
  loaded them: the engine's usual first start);
- the same with one thread, to show what the threads buy;
- ``warm``: the digests kept by the run before (a restart on the same files).

Each row gives the seconds, GiB/s, and the bytes the process read (``/proc/self/io``'s
``rchar``). It also measures the candidate hashes on one core over 256 MiB in memory (best of
3). Prints a table, writes JSON and a PNG, and deletes the model and its cache at the end.

    PYTHONPATH=. .venv/bin/python scripts/probes/weights_digest_cost.py --out bench-results/weights-digest
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import blake3
import numpy as np

from kvhal.vllm import model_identity
from kvhal.vllm.digest_cache import DigestCache
from kvhal.vllm.file_digests import reading_threads


def bytes_read() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar"))


def hash_rates() -> dict[str, float]:
    data = memoryview(np.random.default_rng(0).bytes(256 << 20))
    hashes = {
        "sha256": lambda: hashlib.sha256(data).digest(),
        "blake2b": lambda: hashlib.blake2b(data).digest(),
        "blake3": lambda: blake3.blake3(data).digest(),
    }
    best = dict.fromkeys(hashes, 0.0)
    for _ in range(3):
        for name, run in hashes.items():
            start = time.perf_counter()
            run()
            best[name] = max(best[name], 0.25 / (time.perf_counter() - start))
    return best


def write_model(root: Path, files: int, gib: int) -> int:
    root.mkdir(parents=True)
    (root / "config.json").write_text('{"hidden_size": 4096}')
    block = np.random.default_rng(1).bytes(64 << 20)
    total = 0
    for i in range(files):
        path = root / f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for j in range(gib * 16):  # 64 MiB at a time, each made distinct by its number
                os.write(fd, j.to_bytes(8, "little") + block[8:])
            os.fsync(fd)
        finally:
            os.close(fd)
        total += path.stat().st_size
    return total


def drop_from_page_cache(root: Path) -> None:
    for path in root.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm_page_cache(root: Path) -> None:
    buf = memoryview(bytearray(8 << 20))
    for path in root.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            pos = 0
            while got := os.preadv(fd, [buf], pos):
                pos += got
        finally:
            os.close(fd)


def timed(label: str, root: Path, cache: Path, size: int, threads: int | None = None) -> dict:
    before, start = bytes_read(), time.perf_counter()
    digest = model_identity.weights_digest(root, cache=DigestCache(cache), threads=threads)
    seconds = time.perf_counter() - start
    read = bytes_read() - before
    return {
        "run": label,
        "seconds": seconds,
        "gib_per_s": size / (1 << 30) / seconds,
        "bytes_read": read,
        "threads": threads or reading_threads(),
        "digest": digest,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--files", type=int, default=2)
    parser.add_argument("--gib", type=int, default=2, help="GiB per file")
    parser.add_argument("--out", type=Path, default=Path("bench-results/weights-digest"))
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvhal-weights-", dir=args.dir))
    root, cache = work / "model", work / "cache"
    try:
        rates = hash_rates()
        size = write_model(root, args.files, args.gib)
        time.sleep(model_identity.SETTLE_NS / 1e9 + 0.5)  # old enough to be kept
        rows = []
        drop_from_page_cache(root)
        start, before = time.perf_counter(), bytes_read()
        warm_page_cache(root)  # the disk's own pace, one thread, nothing hashed: the floor
        seconds = time.perf_counter() - start
        floor = {"run": "read only, from disk", "seconds": seconds, "gib_per_s": size / (1 << 30) / seconds}
        floor |= {"bytes_read": bytes_read() - before, "threads": 1, "digest": None}
        drop_from_page_cache(root)
        rows.append(timed("cold, from disk", root, cache, size))
        shutil.rmtree(cache)
        warm_page_cache(root)
        rows.append(timed("cold, page cache, 1 thread", root, cache, size, threads=1))
        shutil.rmtree(cache)
        rows.append(timed("cold, page cache", root, cache, size))
        rows.append(timed("warm (digests kept)", root, cache, size))
        assert len({r["digest"] for r in rows}) == 1, "the runs disagree on the digest"
        rows.insert(0, floor)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    load = os.getloadavg()[0]
    print(f"model: {args.files} files, {size / (1 << 30):.1f} GiB; {os.cpu_count()} cores, load {load:.1f}")
    print("hash on one core, GiB/s: " + ", ".join(f"{k} {v:.2f}" for k, v in rates.items()))
    print("| run | threads | seconds | GiB/s | bytes read |\n| --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        cells = [r["run"], r["threads"], f"{r['seconds']:.3f}", f"{r['gib_per_s']:.2f}"]
        cells.append(f"{r['bytes_read']:,}")
        print("| " + " | ".join(map(str, cells)) + " |")
    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "bytes": size,
        "files": args.files,
        "load": load,
        "cores": os.cpu_count(),
        "hash_gib_per_s": rates,
    }
    (args.out / "weights_digest.json").write_text(json.dumps({**result, "runs": rows}, indent=1) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3))
    ax.barh([r["run"] for r in rows][::-1], [r["seconds"] for r in rows][::-1])
    ax.set_xlabel(f"seconds to name a {size / (1 << 30):.0f} GiB model")
    fig.tight_layout()
    fig.savefig(args.out / "weights_digest.png", dpi=120)
    print(f"wrote {args.out}/weights_digest.json and .png")


if __name__ == "__main__":
    main()
