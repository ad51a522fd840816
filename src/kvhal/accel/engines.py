"""Copy engines and the chain that falls back from one to the next.

A copy engine enqueues a job's descriptors on the job's stream with one
vendor call or another (a batched driver call, a loop of async copies, a
custom op, ``Tensor.copy_``). A plugin lists the engines its machine offers,
best first (a pure decision it can unit-test), and an :class:`EngineChain`
runs them:

- an engine that fails before it ever worked (a driver that lacks the symbol,
  an ABI that rejects the call) is dropped with a warning and the job runs on
  the next one;
- an engine that refuses one job's arguments (:class:`CopyArgumentError`:
  the vendor named a bad copy, or the stream is one it cannot use) is kept:
  only that job runs on the next engine. One odd job does not take the best
  engine away from every later one;
- any other failure of an engine that has worked is the copy's failure.

Re-running a job is harmless: it writes the same bytes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch

from kvhal.accel.descriptors import Descriptors
from kvhal.accel.torch_copy import torch_copy
from kvhal.copyplan import CopyPlan, Direction

log = logging.getLogger(__name__)


class CopyArgumentError(ValueError):
    """A copy engine refused this job's arguments; the engine itself may work for others.

    Engines raise it only where the failure is the job's: a copy the vendor
    names as invalid, a stream the engine cannot enqueue on. Everything else
    an engine raises counts as the engine failing.
    """


@dataclass(frozen=True)
class CopyJob:
    """One block copy, ready for an engine.

    :param plan: the validated plan (its caches keep the memory alive).
    :param descriptors: the byte descriptors to execute.
    :param direction: host/device direction of the copy.
    :param stream: the stream to enqueue on (the caller has entered it).
    :param source_early: the source may be read out of stream order
        (only ever true for loads whose host source nothing in flight writes).
    :param enter_stream: makes ``stream`` torch's current stream while it is entered; the
        chain enters it only for engines that enqueue on the current stream (entering
        torch's stream context costs tens of microseconds, per copy and layer).
    :param enter_device: makes ``stream``'s device torch's current one (a thread whose current
        device is another GPU); entered for the other engines. A thread that never used the
        device is not enough for it: on an H200, ``cuMemcpyBatchAsync`` failed from such a
        thread even inside it (BENCHMARKS.md, "Layer by layer on an NVIDIA H200").
    """

    plan: CopyPlan
    descriptors: Descriptors
    direction: Direction
    stream: Any
    source_early: bool = False
    enter_stream: Callable[[], AbstractContextManager[Any]] = nullcontext
    enter_device: Callable[[], AbstractContextManager[Any]] = nullcontext


class CopyEngine(Protocol):
    """Enqueues a job's copies on its stream; raises if it could not."""

    name: str
    #: Whether a batch of descriptors goes to the device in one call.
    batched: bool
    #: Whether it enqueues on torch's current stream (a torch op), so that the job's stream
    #: must be entered first; an engine that passes the stream's handle itself says False.
    #: Taken as True where an engine does not say.
    on_current_stream: bool

    def run(self, job: CopyJob) -> None: ...


def on_current_stream(engine: CopyEngine) -> bool:
    """Whether ``engine`` needs the job's stream entered (True unless it says otherwise)."""
    return getattr(engine, "on_current_stream", True)


class TorchCopyEngine:
    """``Tensor.copy_`` per descriptor over byte views: works wherever torch does."""

    name = "torch.copy_"
    batched = False
    on_current_stream = True

    def run(self, job: CopyJob) -> None:
        torch_copy(job.plan.src, job.plan.dst, job.descriptors)


class SizeSplitEngine:
    """Descriptors of at least ``min_bytes`` go to ``large``, the rest to ``small``.

    For batched calls that lose to per-copy calls below a break-even size.
    """

    def __init__(self, large: CopyEngine, small: CopyEngine, min_bytes: int) -> None:
        self.large, self.small, self.min_bytes = large, small, min_bytes
        self.name = f"{large.name} (>= {min_bytes} B) + {small.name}"
        self.batched = large.batched
        self.on_current_stream = on_current_stream(large) or on_current_stream(small)

    def run(self, job: CopyJob) -> None:
        large, small = job.descriptors.split_by_size(self.min_bytes)
        for engine, part in ((self.large, large), (self.small, small)):
            if len(part):
                engine.run(replace(job, descriptors=part))


class EngineChain:
    """Runs jobs on the first engine that works; see the module docstring.

    :attr dropped: ``(engine name, reason)`` of every engine dropped, in order.
    :attr argument_failures: per engine name, how many jobs it refused
        (:class:`CopyArgumentError`) and passed on.
    """

    def __init__(self, engines: Sequence[CopyEngine]) -> None:
        if not engines:
            raise ValueError("an engine chain needs at least one engine")
        self._engines = list(engines)
        self._live = list(range(len(self._engines)))
        self._proven: set[int] = set()
        self._lock = threading.Lock()
        self.dropped: list[tuple[str, str]] = []
        self.argument_failures: dict[str, int] = {}

    @property
    def active(self) -> CopyEngine:
        with self._lock:
            return self._engines[self._live[0]]

    @property
    def names(self) -> list[str]:
        with self._lock:
            return [self._engines[i].name for i in self._live]

    def run(self, job: CopyJob) -> None:
        with self._lock:
            order = list(self._live)
        for position, index in enumerate(order):
            engine = self._engines[index]
            last = position == len(order) - 1
            try:
                with job.enter_stream() if on_current_stream(engine) else job.enter_device():
                    engine.run(job)
            except CopyArgumentError as exc:
                self._refused(engine, exc, None if last else self._engines[order[position + 1]])
                if last:
                    raise
                continue
            except Exception as exc:
                with self._lock:
                    if index in self._proven or last:
                        raise
                    self._drop(index, exc, self._engines[order[position + 1]])
                continue
            with self._lock:
                self._proven.add(index)
            return

    def _refused(self, engine: CopyEngine, exc: CopyArgumentError, successor: CopyEngine | None) -> None:
        with self._lock:
            count = self.argument_failures.get(engine.name, 0) + 1
            self.argument_failures[engine.name] = count
        # Warn once per engine; a caller repeating the same mistake would flood the log.
        log.log(
            logging.WARNING if count == 1 else logging.DEBUG,
            "kvhal: copy engine %s refused a job's arguments (%s); %s, the engine stays in use",
            engine.name,
            exc,
            f"the job runs on {successor.name}" if successor is not None else "no engine left for it",
        )

    def _drop(self, index: int, exc: Exception, successor: CopyEngine) -> None:
        """Drop never-proven engine ``index`` (caller holds the lock)."""
        if index not in self._live or len(self._live) == 1:
            return
        self._live.remove(index)
        engine = self._engines[index]
        reason = f"{type(exc).__name__}: {exc}"
        self.dropped.append((engine.name, reason))
        log.warning(
            "kvhal: copy engine %s failed before it ever worked (%s); using %s",
            engine.name,
            reason,
            successor.name,
        )


def build_engines(
    names: Sequence[str],
    make: dict[str, Callable[[], CopyEngine]],
    *,
    fallback: bool = True,
) -> list[CopyEngine]:
    """Engines for ``names`` in order, skipping (with a warning) those that cannot be built.

    With ``fallback=False`` (an engine forced by name) an engine that cannot be
    built is an error instead.
    """
    engines: list[CopyEngine] = []
    for name in names:
        try:
            engines.append(make[name]())
        except Exception as exc:
            if not fallback:
                raise RuntimeError(f"copy engine {name} was forced but is unavailable: {exc}") from exc
            log.warning("kvhal: copy engine %s is unavailable (%s: %s)", name, type(exc).__name__, exc)
    if not engines:
        engines.append(TorchCopyEngine())
    return engines


def apply_forced(names: list[str], forced: str | None, known: Sequence[str], env: str) -> list[str]:
    """``names``, or only ``forced`` when one is given (named by ``env``).

    :raises ValueError: ``forced`` is not one of ``known``.
    """
    if not forced:
        return names
    if forced not in known:
        raise ValueError(f"{env}={forced!r} is not an engine; choose one of {', '.join(known)}")
    return [forced]


def op_registered(namespace: str, name: str) -> bool:
    """Whether ``torch.ops.<namespace>.<name>`` resolves now (looked up afresh, without
    importing the library that registers it)."""
    try:
        getattr(getattr(torch.ops, namespace), name)
    except (AttributeError, RuntimeError):
        return False
    return True


def op_has_argument(op: object, name: str) -> bool:
    """Whether a torch custom op's schema (``op`` or its ``.default`` overload) has argument ``name``."""
    schema = getattr(getattr(op, "default", op), "_schema", None)
    arguments = getattr(schema, "arguments", None) or ()
    return any(getattr(a, "name", None) == name for a in arguments)


def engine_details(engines: Sequence[str]) -> dict[str, str]:
    """What ``kvhal devices`` shows about a plugin's copy engines (best first)."""
    return {"copy_engine": engines[0], "copy_engine_fallbacks": ", ".join(engines[1:]) or "none"}
