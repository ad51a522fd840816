"""A process that keeps a share of one core busy (``kvhal bench chat --spin``): what any work
beside the forward costs its engine steps, with no store and no kvhal thread involved.

``python spinner.py SHARE PARENT_PID`` spins ``SHARE`` of every 10 ms (0.07: 0.7 ms) until
killed, or until process PARENT_PID, which started it, is gone.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator

PERIOD_S = 0.010


def spin(share: float, parent: int) -> None:
    """Busy for ``share`` of every :data:`PERIOD_S`, asleep the rest, while process ``parent``
    (the one that started it) is its parent: a bench killed outright leaves no spinner behind,
    even one killed before the spinner started."""
    busy = share * PERIOD_S
    while os.getppid() == parent:
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
    # run as a file: it needs the standard library only, not kvhal's package
    process = subprocess.Popen([sys.executable, __file__, str(share), str(os.getpid())])
    time.sleep(0.2)
    if process.poll() is not None:
        raise RuntimeError(f"the spinner ({__file__} {share}) exited at once: {process.returncode}")
    try:
        yield
    finally:
        process.kill()
        process.wait()


def share_of_a_core(text: str) -> float:
    """``--spin``'s argument: a share of one core, more than 0 and less than 1."""
    share = float(text)
    if not 0 < share < 1:
        raise argparse.ArgumentTypeError(f"a share of one core is more than 0 and less than 1, got {text}")
    return share


if __name__ == "__main__":
    spin(float(sys.argv[1]), int(sys.argv[2]))
