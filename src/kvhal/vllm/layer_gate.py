"""The workers' layer-by-layer load gate: a large synchronous load copied one layer at a time.

Once vLLM is seen to wait for each layer's load (``wait_for_layer_load`` called for every
layer of a forward), a synchronous load of at least :data:`LAYERWISE_MIN_LAYER_BYTES` per layer (where
copies run beside compute; always with ``load_mode="layerwise"``) is submitted layer by
layer, and each layer's attention waits for its own copies only: the first layers compute
while the later ones copy. A layer that runs without waiting for its copies has its blocks
recomputed, and loads no longer go layer by layer.

The copies are submitted on the engine's thread before the forward, or, with
``layer_submit_thread``, by a thread of kvhal's while the engine's thread launches the
forward: each layer's attention then waits until its own copies are submitted. Measured on
an H200 (``plugins/cuda/tools/layerwise_submit.py``, BENCHMARKS.md): kvhal's thread wins where
the engine's thread holds the GIL little per layer (a driver queue blocks the thread that
submits a few thousand descriptors until its stream drains), and loses where the model's
Python holds it (the submitting thread then waits for the GIL).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

from vllm.logger import init_logger

from kvhal.cache import KVCache
from kvhal.copyplan import CopyPlan, plan_by_layer
from kvhal.descriptor import Capability
from kvhal.device import Device
from kvhal.offload.transfer import TransferEngine, TransferKind
from kvhal.threads import named_pool
from kvhal.vllm.config import ConnectorConfig, GroupInfo
from kvhal.vllm.metadata import TransferJob

logger = init_logger("vllm." + __name__)  # under "vllm": its handlers and level

#: A synchronous load of at least this many bytes per layer (this worker's share) is copied
#: layer by layer, once vLLM is seen to wait per layer (``wait_for_layer_load``): each
#: layer's attention waits for its own copy, so the first layers compute while the later
#: ones copy. A smaller one is one copy, waited for whole before the forward. A layer's copy
#: costs its submitting thread 50-95 us on an H200's host (about 4 MiB at its 50 GB/s link):
#: there, loads of 8 and 32 MiB (32 layers) ended the forward later layer by layer than as
#: one copy, 128 MiB as late or earlier, 512 MiB earlier (BENCHMARKS.md).
LAYERWISE_MIN_LAYER_BYTES = 4 << 20

#: How long a layer's attention waits for its copies to be submitted by kvhal's thread (a
#: submission blocks at most until the copy stream drains: milliseconds). Past it the jobs
#: not yet submitted whole fail, and vLLM recomputes their blocks.
SUBMIT_WAIT_S = 30.0


@dataclass
class _Step:
    """One step's layer-by-layer loads: what the submitting thread writes, the engine's reads.

    Each layer's copies (engine job -> load job) and whether they are all submitted; the load
    jobs a copy of which was refused. A thread given up on keeps writing only into its own
    step, which nobody reads any more.
    """

    layers: list[str]
    jobs: list[int] = field(default_factory=list)
    copies: dict[str, dict[int, int]] = field(default_factory=dict)
    refused: set[int] = field(default_factory=set)
    cancel: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.submitted = {name: threading.Event() for name in self.layers}

    def end(self) -> None:
        """Nothing more is submitted: no layer waits for this step any more."""
        for event in self.submitted.values():
            event.set()


class LayerGate:
    """One worker's per-layer views of its KV caches and the copies each layer waits for."""

    def __init__(self, config: ConnectorConfig) -> None:
        self.config = config
        # layer name -> (group, index); per group, its (device, host) caches and their
        # one-layer views (kept: a view's segments are derived once)
        self._layer_of: dict[str, tuple[int, int]] = {}
        self._caches: dict[int, tuple[KVCache, KVCache]] = {}
        self._layer_views: dict[int, tuple[list[KVCache], list[KVCache]]] = {}
        self._step = _Step([])  # this step's loads
        self._submitting: Future[None] | None = None  # the submitting thread's work
        self._pool: ThreadPoolExecutor | None = None
        self._waited: set[str] = set()  # the layers vLLM waited for in this forward
        self.layerwise = False  # whether vLLM waits for every layer
        #: Whether the copies are submitted by kvhal's thread (``layer_submit_thread``) or
        #: on the engine's thread.
        self.off_thread = False

    def add_group(self, group: GroupInfo, cache: KVCache, host: KVCache) -> None:
        """Take ``group``'s layers: its device cache and its host view, one layer at a time."""
        layers = range(len(group.layer_names))
        self._caches[group.group_id] = (cache, host)
        self._layer_views[group.group_id] = (
            [cache.of_layers([i]) for i in layers],
            [host.of_layers([i]) for i in layers],
        )
        self._layer_of.update({name: (group.group_id, i) for i, name in enumerate(group.layer_names)})

    def takes(self, job: TransferJob, device: Device | None) -> bool:
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

    def submit(self, engine: TransferEngine, jobs: list[TransferJob]) -> set[int]:
        """Start submitting ``jobs``' copies layer by layer, every job's first layer first (the
        copies run in submission order), on kvhal's thread where :attr:`off_thread`; the jobs
        refused before any byte moves (logged). :meth:`wait_for` hands out each layer's copies,
        :meth:`end_forward` the rest and the jobs refused later.

        Each job is checked once and its copy cut into layers (:func:`plan_by_layer`), and the
        load stream is ordered after compute once, here, on the engine's thread.
        """
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
        runnable = [job for job in jobs if job.job_id not in refused]
        if not runnable:
            return refused
        engine.order_after_compute(TransferKind.LOAD)
        step = self._step = _Step(list(self._layer_of), [job.job_id for job in runnable])
        if self.off_thread:
            if self._pool is None:
                self._pool = named_pool(1, "kvhal-layers")
            self._submitting = self._pool.submit(self._submit_layers, step, engine, runnable, plans)
        else:
            self._submit_layers(step, engine, runnable, plans)
        return refused

    def _submit_layers(
        self,
        step: _Step,
        engine: TransferEngine,
        jobs: list[TransferJob],
        plans: dict[tuple[int, int], list[CopyPlan]],
    ) -> None:
        try:
            for name, (group_id, index) in self._layer_of.items():
                for job in jobs:
                    layer_plans = plans.get((job.job_id, group_id))
                    if layer_plans is None or job.job_id in step.refused or step.cancel.is_set():
                        continue
                    try:
                        copy = engine.submit_plan(TransferKind.LOAD, layer_plans[index], after_compute=False)
                    except Exception:  # the job fails: no later layer of it is submitted
                        logger.exception("kvhal: load job %d refused at layer %r", job.job_id, name)
                        step.refused.add(job.job_id)
                        continue
                    step.copies.setdefault(name, {})[copy] = job.job_id
                step.submitted[name].set()
        finally:  # a layer never waits for a thread that stopped
            step.end()

    def wait_for(self, name: str) -> dict[int, int] | None:
        """vLLM's attention of layer ``name`` is about to run: the copies it waits for
        (engine job -> load job), once they are submitted (at most :data:`SUBMIT_WAIT_S`)."""
        self._waited.add(name)
        step = self._step
        submitted = step.submitted.get(name)
        if submitted is not None and not submitted.wait(SUBMIT_WAIT_S):
            self._give_up(f"layer {name!r}'s copies were not submitted within {SUBMIT_WAIT_S:.0f} s")
        return step.copies.pop(name, None)

    def _give_up(self, why: str) -> None:
        """The submitting thread is stuck: every job of the step fails (recomputed), and later
        loads are submitted on the engine's thread."""
        logger.error("kvhal: %s; this step's layer-by-layer loads fail and are recomputed", why)
        step = self._step
        step.cancel.set()
        step.end()
        step.refused.update(step.jobs)
        self.off_thread = False

    def end_forward(self) -> tuple[dict[int, int], set[int]]:
        """After the forward: vLLM waits per layer if it waited for every layer in it (then
        later loads may go layer by layer). The copies no layer waited for (engine job ->
        load job: their blocks are recomputed, and loads no longer go layer by layer), and the
        load jobs a copy of which was refused or not submitted in time."""
        if self._submitting is not None and not self._step.cancel.is_set():  # not given up on yet
            try:
                self._submitting.result(timeout=SUBMIT_WAIT_S)
            except FutureTimeout:
                self._give_up(f"the layers' copies were not all submitted within {SUBMIT_WAIT_S:.0f} s")
            except Exception as exc:  # a bug in the thread: its jobs fail, the engine goes on
                self._give_up(f"the thread submitting the layers' copies failed ({exc!r})")
        self._submitting = None
        if not self.layerwise and self._layer_of and self._waited.issuperset(self._layer_of):
            self.layerwise = True
            logger.info("kvhal: vLLM waits for each layer's load: large synchronous loads go layer by layer")
        step, self._step = self._step, _Step([])
        # snapshots: a thread given up on may still be adding to them
        left = {copy: job for copies in list(step.copies.values()) for copy, job in list(copies.items())}
        if left and not step.cancel.is_set():  # a layer ran without waiting: its blocks are recomputed
            logger.warning(
                "kvhal: vLLM did not wait for the loads of layers %s; their blocks are recomputed, "
                "and loads no longer go layer by layer",
                sorted(list(step.copies)),
            )
            self.layerwise = False
        self._waited.clear()
        return left, set(step.refused)

    def shutdown(self) -> None:
        """Stop kvhal's submitting thread (a submission in flight ends on its own)."""
        self._step.cancel.set()
        if self._pool is not None:
            self._pool.shutdown(wait=False)
