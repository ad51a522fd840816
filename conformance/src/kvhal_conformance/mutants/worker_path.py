"""Mutants of the worker path: defects only an engine's own caches reach. vLLM allocates its
KV cache itself and registers it with the connector; the hook checks copy only caches the plugin
allocated (``kvhal_allocate_kv_cache``), the worker path's traces copy the engine's."""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from kvhal.cache import KVCache
from kvhal.copyplan import CopyPlan
from kvhal.cpu import CPUPlugin
from kvhal.cpu.streams import CPUEvent
from kvhal.geometry import KVGeometry
from kvhal.hookspecs import hookimpl
from kvhal.layouts import KVLayout
from kvhal_conformance.mutants.registry import Stream, _record_after, mutant


def _storage(tensor: torch.Tensor) -> StorageWeakRef:
    return StorageWeakRef(tensor.untyped_storage())


class _KnowsItsMemory(CPUPlugin):
    """The CPU plugin, keeping which storages it allocated: KV caches and host buffers (a weak
    reference each, which keeps its id from being reused while held)."""

    def __init__(self) -> None:
        super().__init__()
        self._caches: dict[int, StorageWeakRef] = {}
        self._host: dict[int, StorageWeakRef] = {}

    @hookimpl
    def kvhal_allocate_kv_cache(
        self, geometry: KVGeometry, layout: KVLayout, device: torch.device
    ) -> KVCache:
        cache = super().kvhal_allocate_kv_cache(geometry, layout, device)
        for layer in cache.layers:
            for part in layer:
                ref = _storage(part)
                self._caches[ref.cdata] = ref
        return cache

    @hookimpl
    def kvhal_allocate_host_buffer(self, nbytes: int) -> torch.Tensor:
        buffer = super().kvhal_allocate_host_buffer(nbytes)
        ref = _storage(buffer)
        self._host[ref.cdata] = ref
        return buffer

    @staticmethod
    def _held(cache: KVCache, refs: dict[int, StorageWeakRef]) -> bool:
        return _storage(cache.layers[0][0]).cdata in refs

    def damage(self, plan: CopyPlan, load: bool) -> None:
        """Copy ``plan``, whose device side is memory the plugin did not allocate, wrongly."""
        raise NotImplementedError

    @hookimpl
    def kvhal_copy_blocks(self, plan: CopyPlan, stream: Stream) -> CPUEvent:
        def copy() -> None:  # on the stream: a plan that cannot be read fails through the event
            load = self._held(plan.src, self._host)
            if self._held(plan.dst if load else plan.src, self._caches):
                self.engine.run(*plan.descriptors)
            else:
                self.damage(plan, load)

        return _record_after(stream, copy)


@mutant("worker.path")
class SwapsBlocksInEngineLoads(_KnowsItsMemory):
    """Loads (host -> device) into KV cache memory the plugin did not allocate (the engine's
    own cache) take a fallback path that lands the first two blocks of the mapping in each
    other's place: vLLM's loads serve another block's KV."""

    def damage(self, plan: CopyPlan, load: bool) -> None:
        self.engine.run(*plan.descriptors)
        if load and plan.num_blocks >= 2:
            a, b = (int(x) for x in plan.mapping[:2, 1])
            for layer in plan.dst.layers:
                for part in layer:
                    held = part[a].clone()
                    part[a].copy_(part[b])
                    part[b].copy_(held)


@mutant("worker.path")
class DropsFirstLayerOfEngineStores(_KnowsItsMemory):
    """Stores (device -> host) from KV cache memory the plugin did not allocate (the engine's
    own cache) take a fallback path that leaves the first layer's bytes in host memory as they
    were (its table of layers starts one late): vLLM's stored blocks come back without it."""

    def damage(self, plan: CopyPlan, load: bool) -> None:
        if load:
            self.engine.run(*plan.descriptors)
            return
        ids = [int(x) for x in plan.mapping[:, 1]]
        kept = [part[ids].clone() for part in plan.dst.layers[0]]
        self.engine.run(*plan.descriptors)
        for part, before in zip(plan.dst.layers[0], kept, strict=True):
            part[ids] = before
