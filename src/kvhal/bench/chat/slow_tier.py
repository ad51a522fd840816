"""A lower tier slower than recomputing, for ``kvhal bench chat``'s ``slow`` configuration.

``bench-slow-disk`` is the disk tier with its reads held to ``read_bytes_per_s`` (a tier
option, default :data:`READ_BYTES_PER_S`), as a device of that bandwidth would: reads
queue behind each other, each ends when the bandwidth has carried its bytes. Writes run at
the disk's speed. It is offered to the engine as any third party's tier would be, through a
``kvhal.plugins`` entry point: :func:`install` writes the distribution's metadata into a
folder the engine's ``PYTHONPATH`` then names.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path

from kvhal.discovery import ENTRY_POINT_GROUP
from kvhal.hookspecs import hookimpl
from kvhal.tiers.backend import TierBackend, TierSpec

SLOW_TIER = "bench-slow-disk"
#: 20 MB/s: a returning user's 10 MiB take 0.5 s, recomputing them about 0.1 s here.
READ_BYTES_PER_S = 20e6
DISTRIBUTION = "kvhal_bench_slow_tier-1.0.dist-info"


class SlowTier(TierBackend):
    """A backend whose reads end no sooner than its bandwidth allows (see the module)."""

    def __init__(self, inner: TierBackend, read_bytes_per_s: float) -> None:
        self.inner = inner
        self.num_slots = inner.num_slots
        self.rate = read_bytes_per_s
        self._lock = threading.Lock()
        self._free_at = 0.0  # when the bandwidth is free again

    @property
    def ready(self) -> bool:  # type: ignore[override] - the contract's attribute, the inner tier's
        return self.inner.ready

    @property
    def ready_error(self) -> BaseException | None:  # type: ignore[override]
        return self.inner.ready_error

    def recover(self, progress: Callable[[int, int], None] | None = None) -> tuple[list[int], list[bytes]]:
        return self.inner.recover(progress)

    def write(
        self, slots: Sequence[int], keys: Sequence[bytes], buffers: Sequence[memoryview]
    ) -> Future[list[bool]]:
        return self.inner.write(slots, keys, buffers)

    def read(
        self, slots: Sequence[int], keys: Sequence[bytes], buffers: Sequence[memoryview]
    ) -> Future[list[str | None]]:
        nbytes = sum(memoryview(b).nbytes for b in buffers)
        with self._lock:
            self._free_at = max(self._free_at, time.monotonic()) + nbytes / self.rate
            ready = self._free_at
        inner = self.inner.read(slots, keys, buffers)
        outer: Future[list[str | None]] = Future()

        def finish(done: Future[list[str | None]]) -> None:
            def hand_over() -> None:
                try:
                    outer.set_result(done.result())
                except BaseException as exc:  # the caller sees the inner read's failure
                    outer.set_exception(exc)

            threading.Timer(max(0.0, ready - time.monotonic()), hand_over).start()

        inner.add_done_callback(finish)
        return outer

    def close(self) -> None:
        self.inner.close()


def _open(spec: TierSpec) -> TierBackend:
    from kvhal.tiers.disk import DiskTier

    options = dict(spec.options)
    rate = float(options.pop("read_bytes_per_s", READ_BYTES_PER_S))
    return SlowTier(DiskTier(dataclasses.replace(spec, options=options)), rate)


class SlowTierPlugin:
    """The plugin offering ``bench-slow-disk``."""

    @hookimpl
    def kvhal_tier_backends(self) -> Mapping[str, Callable[[TierSpec], TierBackend]]:
        return {SLOW_TIER: _open}


def install(folder: Path) -> Path:
    """Write the plugin's distribution metadata into ``folder``; put it on ``PYTHONPATH``."""
    info = folder / DISTRIBUTION
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvhal-bench-slow-tier\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        f"[{ENTRY_POINT_GROUP}]\nbench-slow-tier = kvhal.bench.chat.slow_tier:SlowTierPlugin\n"
    )
    return folder
