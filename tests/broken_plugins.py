"""Device plugins with exactly one defect each: the conformance suite must fail every one.

Each is the built-in CPU plugin with one hook changed, the way a real port goes
wrong. ``tests/test_conformance_selftest.py`` runs the suite against each
(``--kvhal-plugin tests.broken_plugins:NAME``) and checks which contract fails
and that the message points at the defect. The suite's own mutants
(:mod:`kvhal_conformance.mutants`, one per clause of the hookspecs) cover the
rest, among them the defects that used to live here (a fresh compute stream, a
missing hook, a synchronous copy, a no-op stream wait, a lying pinned query).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np
import torch

from kvhal.cache import KVCache, allocate_dense_kv_cache
from kvhal.copyplan import CopyPlan, plan_copy
from kvhal.cpu import CPUPlugin
from kvhal.cpu.streams import CPUEvent, CPUStream, InlineStream
from kvhal.geometry import KVGeometry
from kvhal.hookspecs import hookimpl
from kvhal.layouts import LBHNC, KVLayout
from kvhal_conformance.mutants import MovesSources, RecyclesFreedBuffers

Stream = CPUStream | InlineStream


def enqueue(stream: Stream, plan: CopyPlan, work: Callable[[], None]) -> CPUEvent:
    """Submit ``work`` (which copies ``plan``) and return an event recorded after it."""

    def run() -> None:
        assert plan is not None  # keeps the plan, and so its caches' memory, alive until it ran
        work()

    stream.submit(run)
    done = CPUEvent()
    stream.record(done)
    return done


class CopiesWrongBlock(CPUPlugin):
    """Coalesces by sorting source and destination ids separately, losing the pairing."""

    @hookimpl
    def kvhal_copy_blocks(self, plan: CopyPlan, stream: Stream) -> CPUEvent:
        unpaired = np.stack([np.sort(plan.src_ids), np.sort(plan.dst_ids)], axis=1)
        return super().kvhal_copy_blocks(plan_copy(plan.src, plan.dst, unpaired), stream)


class OffByOneLastBlock(CPUPlugin):
    """Bounds-checks block ids against ``num_blocks - 1``: pairs touching a last block are dropped."""

    @hookimpl
    def kvhal_copy_blocks(self, plan: CopyPlan, stream: Stream) -> CPUEvent:
        keep = (plan.src_ids < plan.src.num_blocks - 1) & (plan.dst_ids < plan.dst.num_blocks - 1)
        return super().kvhal_copy_blocks(plan_copy(plan.src, plan.dst, plan.mapping[keep]), stream)


def _unchecked_layout(name: str, stride_order: tuple[int, ...]) -> KVLayout:
    layout = object.__new__(KVLayout)  # skips KVLayout's own validation, as a hand-made one might
    object.__setattr__(layout, "name", name)
    object.__setattr__(layout, "stride_order", stride_order)
    return layout


class StrideOrderNotPermutation(CPUPlugin):
    """Offers a tiled layout whose stride order repeats a dimension (N twice, no C)."""

    @hookimpl
    def kvhal_kv_layouts(self, attention_backend: str | None) -> Sequence[KVLayout]:
        return (
            *super().kvhal_kv_layouts(attention_backend),
            _unchecked_layout("LBHN-tiled", (0, 1, 2, 3, 3)),
        )


class EventBeforeCopy(CPUPlugin):
    """Records the copy's event before queueing the copy: it completes before the copy finishes."""

    @hookimpl
    def kvhal_copy_blocks(self, plan: CopyPlan, stream: Stream) -> CPUEvent:
        done = CPUEvent()
        stream.record(done)
        engine = self.engine
        stream.submit(lambda: engine.run(*plan.descriptors))
        return done


class IgnoresStream(CPUPlugin):
    """Runs every copy on a stream of its own instead of the one it is given."""

    def __init__(self) -> None:
        super().__init__()
        self._own = CPUStream("ignores-the-stream")

    @hookimpl
    def kvhal_copy_blocks(self, plan: CopyPlan, stream: Stream) -> CPUEvent:
        return super().kvhal_copy_blocks(plan, self._own)


class WrongDtype(CPUPlugin):
    """Allocates bfloat16 caches as float16 (the same size, the wrong type)."""

    @hookimpl
    def kvhal_allocate_kv_cache(
        self, geometry: KVGeometry, layout: KVLayout, device: torch.device
    ) -> KVCache:
        if geometry.dtype == torch.bfloat16:
            geometry = dataclasses.replace(geometry, dtype=torch.float16)
        return super().kvhal_allocate_kv_cache(geometry, layout, device)


class TruncatesBatch(CPUPlugin):
    """Sends at most 256 descriptors per copy (a device API's batch limit) and drops the rest."""

    MAX_DESCRIPTORS = 256

    @hookimpl
    def kvhal_copy_blocks(self, plan: CopyPlan, stream: Stream) -> CPUEvent:
        src, dst, sizes = (a[: self.MAX_DESCRIPTORS] for a in plan.descriptors)
        engine = self.engine
        return enqueue(stream, plan, lambda: engine.run(src, dst, sizes))


class MutatesSource(MovesSources):
    """Clears the source after copying it, as if the copy were a move."""

    move_below = float("inf")  # every copy


class DirtyHostBuffer(CPUPlugin):
    """Hands out host buffers without clearing them (``torch.empty`` where ``zeros`` was meant)."""

    @hookimpl
    def kvhal_allocate_host_buffer(self, nbytes: int) -> torch.Tensor:
        buffer = super().kvhal_allocate_host_buffer(nbytes)
        buffer.fill_(0x5A)  # what a reused allocation may hold
        return buffer


class Mislabels(CPUPlugin):
    """Lays every cache out in LBHNC, whatever layout was asked for, and labels it as asked."""

    @hookimpl
    def kvhal_allocate_kv_cache(
        self, geometry: KVGeometry, layout: KVLayout, device: torch.device
    ) -> KVCache:
        return dataclasses.replace(allocate_dense_kv_cache(geometry, LBHNC, device), layout=layout)


class SharedLayers(CPUPlugin):
    """Allocates one layer's memory and hands out that same view for every layer."""

    @hookimpl
    def kvhal_allocate_kv_cache(
        self, geometry: KVGeometry, layout: KVLayout, device: torch.device
    ) -> KVCache:
        one = allocate_dense_kv_cache(dataclasses.replace(geometry, num_layers=1), layout, device)
        return KVCache(geometry, layout, one.layers * geometry.num_layers, one.storage)


class RecyclesDirty(RecyclesFreedBuffers):
    """Keeps freed host buffers and hands them out again, as they were, for the same size."""

    recycle_bytes = 0  # every size
