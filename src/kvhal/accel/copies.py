"""``kvhal_copy_blocks`` for torch stream devices, over an :class:`EngineChain`.

The plugin supplies its stream module and engine chain; this hook

0. refuses a stream the device cannot copy on (:meth:`EngineCopyHooks.check_copy_stream`),
   raising before any byte moves, and cuts descriptors where the host memory
   they cover changes registration (:meth:`EngineCopyHooks.host_split_points`);
1. tells torch's caching allocator that ``stream`` uses the device caches;
2. runs host-to-host copies on the CPU after draining ``stream``, and every
   other copy on the engine chain, letting the source be read out of stream
   order only for loads whose host source no unfinished store writes
   (:mod:`kvhal.accel.host_writes`); the chain enters ``stream`` for engines that
   enqueue on the current stream (ops, ``Tensor.copy_``), while driver calls get
   ``stream``'s handle from the job and run with its device current (what the stream
   context did for them before; it costs tens of microseconds per copy and layer);
3. records an event after the copy; a submission failure is carried by it.

Ordering after compute is :meth:`kvhal.device.Device.submit`'s job: it makes
``stream`` wait for the compute stream before calling the hook.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from kvhal import env
from kvhal.accel.descriptors import Descriptors
from kvhal.accel.engines import CopyEngine, CopyJob, EngineChain, build_engines
from kvhal.accel.events import CopyEvent
from kvhal.accel.host_writes import PendingHostWrites, source_may_be_read_early
from kvhal.accel.streams import TorchStreamHooks
from kvhal.accel.torch_copy import torch_copy
from kvhal.cache import KVCache
from kvhal.copyplan import CopyPlan, Direction
from kvhal.hookspecs import hookimpl

_NO_POINTS = np.zeros(0, dtype=np.int64)


class KeepAlive:
    """Tells torch's caching allocator that a copy stream uses the device caches' memory,
    so freeing a cache while a copy is pending cannot hand the memory to other work.

    Once per cache and stream, and once per allocation: the allocator remembers the streams
    an allocation was used on and, when it is freed, waits for the work queued on them by
    then, so a later copy on the same stream is covered by the first call. (Once per copy
    and layer, this cost a model of many layers hundreds of calls per job, on the engine's
    thread.)
    """

    def __init__(self) -> None:
        self._streams: weakref.WeakKeyDictionary[KVCache, list[Any]] = weakref.WeakKeyDictionary()

    def __call__(self, plan: CopyPlan, stream: Any) -> int:
        """Record ``stream`` on the memory of ``plan``'s device caches; the calls made."""
        calls = 0
        for cache in (plan.src, plan.dst):
            if cache.device.type == "cpu":
                continue
            streams = self._streams.setdefault(cache, [])
            if any(s is stream for s in streams):
                continue
            streams.append(stream)
            allocations: set[int] = set()
            for tensor in cache.storage or tuple(v for parts in cache.layers for v in parts):
                allocation = tensor.untyped_storage().data_ptr()
                if allocation not in allocations:
                    allocations.add(allocation)
                    tensor.record_stream(stream)
                    calls += 1
        return calls


def split_at(descriptors: Descriptors, points: np.ndarray) -> Descriptors:
    """``descriptors`` with every one whose source or destination range strictly
    contains an address of ``points`` cut there, so that no piece spans one.

    The pieces move the same bytes; their order follows the original descriptors.
    """
    if not len(points) or not len(descriptors):
        return descriptors
    src, dst, sizes = descriptors
    for point in points.tolist():
        for side in (0, 1):  # source ranges, then destination ranges
            base = src if side == 0 else dst
            cut = (base < point) & (point < base + sizes)
            if not cut.any():
                continue
            head = np.where(cut, point - base, sizes)  # bytes before the point
            index = np.repeat(np.arange(len(sizes)), 1 + cut.astype(np.int64))
            first = np.ones(len(index), dtype=bool)
            first[1:] = index[1:] != index[:-1]
            shift = np.where(first, 0, head[index])
            src, dst = src[index] + shift, dst[index] + shift
            sizes = np.where(first, head[index], sizes[index] - head[index])
    return Descriptors(src, dst, sizes)


class EngineCopyHooks(TorchStreamHooks):
    """The stream/event hooks plus ``kvhal_copy_blocks`` over an engine chain.

    A plugin names its engines (:meth:`engine_names`, best first, a pure
    decision) and says how to build each (:meth:`engine_factories`); the chain
    is built, resolving vendor symbols, at the first copy.
    """

    #: The environment variable that forces one copy engine (no fallback).
    engine_env: str = ""

    def __init__(self) -> None:
        self.host_writes = PendingHostWrites()
        self.keep_alive = KeepAlive()
        self._chain: EngineChain | None = None
        self._chain_lock = threading.Lock()

    def engine_names(self) -> list[str]:
        """The copy engines this machine offers, best first (or the forced one)."""
        raise NotImplementedError

    def engine_factories(self) -> dict[str, Callable[[], CopyEngine]]:
        """How to build each engine :meth:`engine_names` may name."""
        raise NotImplementedError

    def check_copy_stream(self, stream: Any) -> None:
        """Raise :class:`~kvhal.errors.ValidationError` (argument ``stream``) if copies
        cannot be enqueued on ``stream``; every stream is accepted unless a plugin says otherwise."""

    def host_split_points(self) -> np.ndarray:
        """Host addresses no copy descriptor may span (where one host registration ends
        and the next begins); none unless a plugin says otherwise."""
        return _NO_POINTS

    def forced_engine(self) -> str | None:
        return env.read(self.engine_env) if self.engine_env else None

    def engine_chain(self) -> EngineChain:
        """The copy engines, built on first use."""
        with self._chain_lock:
            if self._chain is None:
                engines = build_engines(
                    self.engine_names(), self.engine_factories(), fallback=not self.forced_engine()
                )
                self._chain = EngineChain(engines)
            return self._chain

    @hookimpl
    def kvhal_copy_blocks(self, plan: CopyPlan, stream: Any) -> CopyEvent:
        self.check_copy_stream(stream)  # raises: nothing is enqueued yet
        module = self.stream_module()
        descriptors: Descriptors | None = None
        direction: Direction | None = None
        error: BaseException | None = None
        try:  # reading the plan is part of the submission: its failure goes to the event too
            descriptors = split_at(Descriptors.of(plan), self.host_split_points())
            direction = plan.direction
            self.keep_alive(plan, stream)
            if direction is Direction.H2H:
                # A CPU memcpy runs outside any stream: let earlier copies on
                # this stream (perhaps into these buffers) finish first.
                stream.synchronize()
                torch_copy(plan.src, plan.dst, descriptors, non_blocking=False)
            elif len(descriptors):
                early = source_may_be_read_early(direction, descriptors, self.host_writes)
                job = CopyJob(
                    plan,
                    descriptors,
                    direction,
                    stream,
                    early,
                    enter_stream=lambda: module.stream(stream),
                    enter_device=lambda: module.device(stream.device),
                )
                self.engine_chain().run(job)
        except Exception as exc:  # reported through the event
            error = exc
        event = CopyEvent(module.Event())
        event.record(stream)
        if error is not None:
            event.fail(error)
        if direction is Direction.D2H and descriptors is not None:  # a failed store may have queued writes
            self.host_writes.add(descriptors, event.inner.query)
        return event
