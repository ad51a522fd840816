"""A process that keeps a share of one core busy (``kvhal bench chat --spin``): what any work
beside the forward costs its engine steps, with no store and no kvhal thread involved.

``python -m kvhal.bench.chat.spinner SHARE`` spins ``SHARE`` of every 10 ms (0.07: 0.7 ms)
until killed.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator

PERIOD_S = 0.010


def spin(share: float) -> None:
    """Busy for ``share`` of every :data:`PERIOD_S`, asleep the rest, forever."""
    busy = share * PERIOD_S
    while True:
        start = time.perf_counter()
        while time.perf_counter() - start < busy:
            pass
        time.sleep(PERIOD_S - busy)


@contextlib.contextmanager
def spinning(share: float | None) -> Iterator[None]:
    """A spinner process while the block runs (none for ``None`` or 0)."""
    if not share:
        yield
        return
    process = subprocess.Popen([sys.executable, "-m", "kvhal.bench.chat.spinner", str(share)])
    try:
        yield
    finally:
        process.kill()
        process.wait()


if __name__ == "__main__":
    spin(float(sys.argv[1]))
