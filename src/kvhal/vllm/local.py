"""The worker side of an engine whose scheduler runs in the same process.

With one worker (no tensor parallelism) vLLM runs the scheduler and the worker in one
process (the engine core), so the scheduler side can read the lower tier into host slots
itself, at lookup, and wait a few milliseconds for it, instead of sending the read to the
worker and learning that it ended from the next step's output (docs/tiers.md, "Prefetch at
lookup"). Workers publish themselves here by the engine's ``engine_id``; nothing else is
shared, and a scheduler that finds no worker (several workers, or another process) sends
its reads to the workers as before.
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvhal.vllm.worker_side import WorkerSide

_lock = threading.Lock()
_workers: weakref.WeakValueDictionary[str, WorkerSide] = weakref.WeakValueDictionary()


def publish(engine_id: str, worker: WorkerSide) -> None:
    with _lock:
        _workers[engine_id] = worker


def withdraw(engine_id: str, worker: WorkerSide) -> None:
    with _lock:
        if _workers.get(engine_id) is worker:
            del _workers[engine_id]


def find(engine_id: str | None) -> WorkerSide | None:
    if engine_id is None:
        return None
    with _lock:
        return _workers.get(engine_id)
