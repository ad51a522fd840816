"""What pinning a host buffer costs at start-up, per GiB, measured where no GPU is.

``cudaHostRegister`` cannot run without a GPU, so this measures the parts of its
work a CPU machine can: mapping the buffer (``map_zeroed``), faulting every page
in (the kernel zeroes each page on first touch), and ``mlock``/``munlock``
(fault in and lock every page, the closest host-side stand-in for registration;
needs ``CAP_IPC_LOCK`` or a large enough ``RLIMIT_MEMLOCK``). The last row times
kvhal-cuda's own synchronous path, :class:`~kvhal_cuda.host_memory.HostRegistrar`
with ``mlock`` standing in for ``cudaHostRegister``, chunk by chunk.

    python plugins/cuda/tools/pin_cost.py --gib 1 --repeat 3
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import os
import statistics
import time

from kvhal.accel.host_buffers import PinMode
from kvhal_cuda.host_memory import PAGE, HostRegistrar, map_zeroed

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.munlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def mlock(address: int, nbytes: int) -> int:
    return 0 if _libc.mlock(address, nbytes) == 0 else ctypes.get_errno()


def run_once(nbytes: int, chunk: int, rows: dict[str, list[float]]) -> None:
    clock = time.perf_counter
    t0 = clock()
    buffer = map_zeroed(nbytes)
    t1 = clock()
    buffer[::PAGE].fill_(1)  # one write per page: the kernel faults in and zeroes each
    t2 = clock()
    fresh = map_zeroed(nbytes)
    t3 = clock()
    code = mlock(fresh.data_ptr(), nbytes)
    t4 = clock()
    _libc.munlock(fresh.data_ptr(), nbytes)
    t5 = clock()
    if code:
        raise SystemExit(f"mlock failed (errno {code}): needs CAP_IPC_LOCK or a larger RLIMIT_MEMLOCK")
    sizes: dict[int, int] = {}
    registrar = HostRegistrar(
        lambda a, n: sizes.__setitem__(a, n) or mlock(a, n),
        lambda a: _libc.munlock(a, sizes.pop(a)),
        PinMode.SYNC,
        max_chunk=chunk,
    )
    t6 = clock()
    pinned = registrar.allocate(nbytes)
    t7 = clock()
    assert registrar.is_pinned(pinned)
    registrar.free(pinned)
    for name, seconds in (
        ("mmap", t1 - t0),
        ("first touch", t2 - t1),
        ("mlock", t4 - t3),
        ("munlock", t5 - t4),
        ("registrar", t7 - t6),
    ):
        rows.setdefault(name, []).append(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gib", type=float, default=1.0, help="buffer size in GiB")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--chunk-mib", type=int, default=256, help="registrar chunk size (MiB)")
    args = parser.parse_args()
    nbytes = int(args.gib * (1 << 30)) // PAGE * PAGE
    rows: dict[str, list[float]] = {}
    for _ in range(args.repeat):
        run_once(nbytes, args.chunk_mib << 20, rows)
    gib = nbytes / (1 << 30)
    print(f"{gib:g} GiB buffer, {args.repeat} runs, {os.cpu_count()} CPUs; seconds per GiB, median (min-max)")
    for name, values in rows.items():
        per = [v / gib for v in values]
        print(f"  {name:12s} {statistics.median(per):8.4f}  ({min(per):.4f}-{max(per):.4f})")


if __name__ == "__main__":
    main()
