"""A job in flight on a worker, whatever its kind, and what it waits for (the worker side keeps
every one in one table, :class:`~kvhal.vllm.worker_side.WorkerSide`); the timer of the worker
side's calls on the engine's thread."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvhal.tiers.backend import ReadOutcome
from kvhal.tiers.chain import TierRead
from kvhal.vllm.metadata import LoadJob, ReadJob, StoreJob, WriteJob

F = TypeVar("F", bound=Callable[..., Any])


@dataclass
class Running:
    """A job in flight on this worker and what it waits for.

    :param copies: its device copies (the transfer engine's jobs).
    :param reads: a load's or a read job's reads into host slots, by tier.
    :param write: a write job's write.
    :param deadline: when a load's reads are given up (its request recomputed).
    :param gave_up: reported failed to vLLM; the job ends once its reads end.
    """

    job: LoadJob | StoreJob | ReadJob | WriteJob
    copies: set[int] = field(default_factory=set)
    reads: dict[str, tuple[TierRead, Future[list[ReadOutcome]]]] = field(default_factory=dict)
    write: Future[list[bool]] | None = None
    deadline: float | None = None
    gave_up: bool = False
    ok: bool = True

    @property
    def sync(self) -> bool:
        return isinstance(self.job, LoadJob) and self.job.sync


def on_engine_thread(method: F) -> F:
    """Count the time a step spends in kvhal: what it can add to the engine's critical path."""

    @functools.wraps(method)
    def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            elapsed = time.perf_counter() - start
            self.busy_seconds += elapsed
            self.stats.add("worker_busy_us", int(elapsed * 1e6))

    return timed  # type: ignore[return-value]
