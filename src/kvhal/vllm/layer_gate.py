"""The workers' layer-by-layer load gate: a large synchronous load copied one layer at a time.

Once vLLM is seen to wait for each layer's load (``wait_for_layer_load`` called for every
layer of a forward), a synchronous load of at least :data:`LAYERWISE_MIN_LAYER_BYTES` per layer (where
copies run beside compute; always with ``load_mode="layerwise"``) is submitted layer by
layer, and each layer's attention waits for its own copies only: the first layers compute
while the later ones copy. A layer that runs without waiting for its copies has its blocks
recomputed, and loads no longer go layer by layer.
"""

from __future__ import annotations

import logging

from kvhal.cache import KVCache
from kvhal.copyplan import CopyPlan, plan_by_layer
from kvhal.descriptor import Capability
from kvhal.device import Device
from kvhal.offload.transfer import TransferEngine, TransferKind
from kvhal.vllm.config import ConnectorConfig, GroupInfo
from kvhal.vllm.metadata import LoadJob

logger = logging.getLogger("vllm." + __name__)  # under "vllm": its handlers and level

#: A synchronous load of at least this many bytes per layer (this worker's share) is copied
#: layer by layer, once vLLM is seen to wait per layer (``wait_for_layer_load``): each
#: layer's attention waits for its own copy, so the first layers compute while the later
#: ones copy. A smaller one is one copy, waited for whole before the forward. A layer's copy
#: costs the engine's thread 50-95 us on an H200's host (about 4 MiB at its 50 GB/s link):
#: there, loads of 8 and 32 MiB (32 layers) ended the forward later layer by layer than as
#: one copy, 128 MiB as late or earlier, 512 MiB earlier (BENCHMARKS.md).
LAYERWISE_MIN_LAYER_BYTES = 4 << 20


class LayerGate:
    """One worker's per-layer views of its KV caches and the copies each layer waits for."""

    def __init__(self, config: ConnectorConfig) -> None:
        self.config = config
        # layer name -> (group, index); per group, its (device, host) caches and their
        # one-layer views (kept: a view's segments are derived once);
        # the copies each layer's attention waits for in this step; the layers vLLM waited
        # for in this forward; whether it waits for every layer
        self._layer_of: dict[str, tuple[int, int]] = {}
        self._caches: dict[int, tuple[KVCache, KVCache]] = {}
        self._layer_views: dict[int, tuple[list[KVCache], list[KVCache]]] = {}
        self._layer_copies: dict[str, list[int]] = {}
        self._waited: set[str] = set()
        self.layerwise = False

    def add_group(self, group: GroupInfo, cache: KVCache, host: KVCache) -> None:
        """Take ``group``'s layers: its device cache and its host view, one layer at a time."""
        layers = range(len(group.layer_names))
        self._caches[group.group_id] = (cache, host)
        self._layer_views[group.group_id] = (
            [cache.of_layers([i]) for i in layers],
            [host.of_layers([i]) for i in layers],
        )
        self._layer_of.update({name: (group.group_id, i) for i, name in enumerate(group.layer_names)})

    def takes(self, job: LoadJob, device: Device | None) -> bool:
        """Whether the synchronous load ``job`` goes layer by layer (on ``device``)."""
        if not self.layerwise or self.config.load_mode == "sync":
            return False
        if self.config.load_mode == "layerwise":
            return True
        # auto: where copies run beside compute (a GPU's DMA engines), not on its cores
        assert device is not None
        layers = max(1, len(self._layer_of))
        return (
            device.descriptor.supports(Capability.OVERLAPPED_COPY)
            and job.num_blocks * self.config.slot_bytes >= LAYERWISE_MIN_LAYER_BYTES * layers
        )

    def submit(self, engine: TransferEngine, jobs: list[LoadJob]) -> tuple[dict[int, set[int]], set[int]]:
        """Submit ``jobs``' copies layer by layer, every job's first layer first (the copies run
        in submission order): each job's copies, and the jobs a copy of which was refused (no
        later layer of them is submitted; logged). :meth:`wait_for` hands out each layer's.

        A job is checked once and its copy cut into layers (:func:`plan_by_layer`), and the
        copy stream is ordered after compute once: per layer only the copy itself is submitted,
        on the engine's thread.
        """
        copies: dict[int, set[int]] = {job.job_id: set() for job in jobs}
        refused: set[int] = set()
        plans: dict[tuple[int, int], list[CopyPlan]] = {}
        for job in jobs:
            for group_id, (block_ids, slots) in job.groups.items():
                if not block_ids or group_id not in self._caches:
                    continue
                cache, host = self._caches[group_id]
                device_layers, host_layers = self._layer_views[group_id]
                try:
                    whole = engine.device.plan_copy(host, cache, list(zip(slots, block_ids, strict=True)))
                    plans[job.job_id, group_id] = plan_by_layer(whole, host_layers, device_layers)
                except Exception:  # a refused copy fails the job: its blocks are load errors
                    logger.exception("kvhal: load job %d refused (group %d)", job.job_id, group_id)
                    refused.add(job.job_id)
        ordered = False  # the load stream waits for compute before its first copy only
        for name, (group_id, index) in self._layer_of.items():
            for job in jobs:
                layer_plans = plans.get((job.job_id, group_id))
                if layer_plans is None or job.job_id in refused:
                    continue
                try:
                    engine_job = engine.submit_plan(
                        TransferKind.LOAD, layer_plans[index], after_compute=not ordered
                    )
                except Exception:
                    logger.exception("kvhal: load job %d refused at layer %r", job.job_id, name)
                    refused.add(job.job_id)
                    continue
                ordered = True
                copies[job.job_id].add(engine_job)
                self._layer_copies.setdefault(name, []).append(engine_job)
        return copies, refused

    def settled(self) -> bool:
        """vLLM was seen to wait for every layer and no copy waits for one: a layer's wait
        has nothing to do (the connector then skips it, six to eighty calls a step)."""
        return self.layerwise and not self._layer_copies

    def wait_for(self, name: str) -> list[int] | None:
        """vLLM's attention of layer ``name`` is about to run: the copies it waits for."""
        self._waited.add(name)
        return self._layer_copies.pop(name, None)

    def end_forward(self) -> list[int]:
        """After the forward: vLLM waits per layer if it waited for every layer in it (then
        later loads may go layer by layer). The copies no layer waited for (their blocks are
        recomputed, and loads no longer go layer by layer)."""
        if not self.layerwise and self._layer_of and self._waited.issuperset(self._layer_of):
            self.layerwise = True
            logger.info("kvhal: vLLM waits for each layer's load: large synchronous loads go layer by layer")
        left = [copy for copies in self._layer_copies.values() for copy in copies]
        if left:  # a layer ran without waiting for its copy: its blocks are recomputed
            logger.warning(
                "kvhal: vLLM did not wait for the loads of layers %s; their blocks are recomputed, "
                "and loads no longer go layer by layer",
                sorted(self._layer_copies),
            )
            self.layerwise = False
        self._layer_copies.clear()
        self._waited.clear()
        return left
