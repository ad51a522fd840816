"""Synchronous loads layer by layer: once vLLM is seen to wait for every layer's load
(``wait_for_layer_load``), a large synchronous load is copied layer by layer and each
layer's attention waits for its own copies only; a layer that ran without waiting gets its
blocks recomputed. The worker side on the CPU plugin, driven as vLLM's model runner does."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

pytest.importorskip("vllm")

from kvhal.descriptor import Capability
from kvhal.hookspecs import hookimpl
from kvhal.vllm import layer_gate
from kvhal.vllm.metadata import KVHALMetadata
from kvhal.vllm.worker_side import WorkerSide
from tests.test_worker_side import (
    LAYERS,
    connector_config,
    cpu_plugin_with,
    kv_caches,
    settle,
    step,
    store,
    sync_load,
)


class LayerGate:
    """Holds the copies into one device layer (by its memory) until opened."""

    def __init__(self) -> None:
        self.layer: int | None = None  # data_ptr of the held layer's first part
        self.open = threading.Event()

    @hookimpl(wrapper=True)
    def kvhal_copy_blocks(self, plan, stream):
        if self.layer is not None and plan.dst.layers[0][0].data_ptr() == self.layer:
            stream.submit(self.open.wait)  # runs before the copy, on the same stream
        return (yield)


@pytest.fixture
def gate(monkeypatch) -> LayerGate:
    gate = LayerGate()
    cpu_plugin_with(monkeypatch, gate, "layer-gate")
    yield gate
    gate.open.set()


def worker(load_mode: str = "auto") -> tuple[WorkerSide, dict]:
    caches = kv_caches(split=True)
    side = WorkerSide(dataclasses.replace(connector_config(), load_mode=load_mode))
    side.register(caches)
    step(side, stores=[store(0, "a", [3, 4], [0, 1])])  # slots 0 and 1 hold blocks 3 and 4
    settle(side)
    return side, caches


def forward(side: WorkerSide, meta: KVHALMetadata, waited=LAYERS):
    """A step with a forward, as vLLM makes it: loads, each layer's wait, stores, results."""
    side.begin_step(meta)
    side.start_loads(meta)
    for name in waited:
        side.wait_for_layer(name)
    side.start_stores(meta)
    return side.collect()


def equal(caches: dict, a: int, b: int, layer: str) -> bool:
    return all(torch.equal(part[a], part[b]) for part in caches[layer])


def test_loads_go_layer_by_layer_once_vllm_is_seen_to_wait_per_layer(gate):
    side, caches = worker("layerwise")
    assert not side.layer_gate.layerwise
    forward(side, KVHALMetadata(loads=[sync_load(1, "b", [9, 10], [0, 1])]))  # whole: not seen yet
    assert side.layer_gate.layerwise and "layerwise_loads" not in side.stats.data
    forward(side, KVHALMetadata(loads=[sync_load(2, "c", [11, 12], [0, 1])]))
    assert side.stats.data["layerwise_loads"] == 1
    assert all(equal(caches, 11, 3, name) and equal(caches, 12, 4, name) for name in LAYERS)
    assert side.take_load_errors() == set() and side.jobs_in_flight == 0
    side.shutdown()


def test_each_layer_waits_for_its_own_copies_only(gate):
    side, caches = worker("layerwise")
    forward(side, KVHALMetadata())  # vLLM waits per layer: seen
    gate.layer = caches[LAYERS[1]][0].data_ptr()  # the second layer's copies are held
    meta = KVHALMetadata(loads=[sync_load(1, "b", [9], [0])])
    side.begin_step(meta)
    first = threading.Thread(target=lambda: (side.start_loads(meta), side.wait_for_layer(LAYERS[0])))
    first.start()
    first.join(timeout=10)
    assert not first.is_alive(), "the first layer waited for the second layer's copy"
    assert equal(caches, 9, 3, LAYERS[0]) and not equal(caches, 9, 3, LAYERS[1])
    second = threading.Thread(target=side.wait_for_layer, args=(LAYERS[1],))
    second.start()
    second.join(timeout=0.5)
    assert second.is_alive(), "the second layer ran before its copy"
    gate.open.set()
    second.join(timeout=10)
    assert equal(caches, 9, 3, LAYERS[1])
    side.start_stores(meta)
    side.collect()
    assert side.take_load_errors() == set()
    side.shutdown()


def test_a_layer_that_ran_without_waiting_gets_its_blocks_recomputed(gate):
    """The negative control: vLLM skipped a layer's wait, so its blocks may have been read
    before their copy: reported as load errors (vLLM recomputes them), and loads go whole."""
    side, _ = worker("layerwise")
    forward(side, KVHALMetadata())
    forward(side, KVHALMetadata(loads=[sync_load(1, "b", [9, 10], [0, 1])]), waited=LAYERS[:1])
    assert side.take_load_errors() == {9, 10}
    assert not side.layer_gate.layerwise
    side.shutdown()


def test_a_layer_by_layer_load_is_checked_and_ordered_once_per_job(gate, monkeypatch):
    """The engine's thread checks a job once (not once per layer) and orders the load
    stream after compute once; the copies still move every layer's bytes."""
    side, caches = worker("layerwise")
    forward(side, KVHALMetadata())
    calls = {"plan_copy": 0, "order_after_compute": 0}
    for name in calls:
        real = getattr(side.device, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(side.device, name, counted)
    jobs = [sync_load(1, "b", [9, 10], [0, 1]), sync_load(2, "c", [11], [1])]
    forward(side, KVHALMetadata(loads=jobs))
    assert side.stats.data["layerwise_loads"] == 2
    assert calls == {"plan_copy": 2, "order_after_compute": 1}, calls
    for name in LAYERS:
        assert equal(caches, 9, 3, name) and equal(caches, 10, 4, name) and equal(caches, 11, 4, name)
    assert side.take_load_errors() == set()
    side.shutdown()


def test_a_refused_layer_by_layer_job_is_recomputed_and_the_others_load(gate):
    """A job whose copy is refused (a device block out of range) moves no byte: its blocks
    are load errors, and the other job of the step loads."""
    side, caches = worker("layerwise")
    forward(side, KVHALMetadata())
    before = [part.clone() for part in caches[LAYERS[0]]]
    jobs = [sync_load(1, "b", [9, 10_000], [0, 1]), sync_load(2, "c", [11], [1])]
    forward(side, KVHALMetadata(loads=jobs))
    assert side.take_load_errors() == {9, 10_000}
    assert all(torch.equal(a[9], b[9]) for a, b in zip(caches[LAYERS[0]], before, strict=True))
    assert all(equal(caches, 11, 4, name) for name in LAYERS)
    assert side.jobs_in_flight == 0
    side.shutdown()


@pytest.mark.parametrize(
    ("mode", "overlapped", "min_bytes", "layer_by_layer"),
    [
        ("auto", True, 0, True),  # a GPU's copies run beside compute: large loads by layer
        ("auto", True, None, False),  # a small load: one copy
        ("auto", False, 0, False),  # the CPU's copies share its cores with the forward
        ("layerwise", False, None, True),  # the operator's choice
        ("sync", True, 0, False),
    ],
)
def test_which_loads_go_layer_by_layer(gate, monkeypatch, mode, overlapped, min_bytes, layer_by_layer):
    if min_bytes is not None:
        monkeypatch.setattr(layer_gate, "LAYERWISE_MIN_LAYER_BYTES", min_bytes)
    side, caches = worker(mode)
    if overlapped:  # as a GPU plugin declares it
        caps = side.device.descriptor.capabilities | {Capability.OVERLAPPED_COPY.value}
        side.device.descriptor = dataclasses.replace(side.device.descriptor, capabilities=caps)
    forward(side, KVHALMetadata())
    forward(side, KVHALMetadata(loads=[sync_load(1, "b", [9, 10], [0, 1])]))
    assert ("layerwise_loads" in side.stats.data) is layer_by_layer
    assert all(equal(caches, 9, 3, name) and equal(caches, 10, 4, name) for name in LAYERS)
    side.shutdown()
