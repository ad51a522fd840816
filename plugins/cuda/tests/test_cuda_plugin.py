"""kvhal-cuda as kvhal loads it, and its copy path end to end over host memory."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvhal.accel.fakes import FakeStreamModule, as_if_direction
from kvhal.accel.host_buffers import PinMode
from kvhal.blocks import get_kv_from_block
from kvhal.cache import allocate_dense_kv_cache
from kvhal.copyplan import Direction, plan_copy
from kvhal.geometry import KVGeometry
from kvhal.layouts import LBHNC
from kvhal.registry import PluginRegistry
from kvhal_cuda import native
from kvhal_cuda.engines import BatchEngine, RuntimeLoopEngine, TorchCopyEngine
from kvhal_cuda.facts import TorchFacts
from kvhal_cuda.fakes import FakeVendorLibrary
from kvhal_cuda.host_memory import HostRegistrar
from kvhal_cuda.plugin import CUDAPlugin

FACTS = TorchFacts(
    torch_version="2.13.0+cu128",
    cuda_version="12.8",
    device_count=1,
    driver_version=12080,
    runtime_library="/fake/libcudart.so.12",
)


class FakeCUDA(CUDAPlugin):
    """CUDAPlugin with a fake torch.cuda, a fake libcudart and a fake cuMemcpyBatchAsync."""

    def __init__(self, library: FakeVendorLibrary) -> None:
        self.library = library
        registered: list[int] = []
        registrar = HostRegistrar(lambda a, n: registered.append(a) or 0, lambda a: 0, PinMode.SYNC)
        super().__init__(facts=FACTS, stream_module=FakeStreamModule(hold_events=True), registrar=registrar)

    def engine_factories(self):
        return {
            "cuMemcpyBatchAsync": lambda: BatchEngine(self.library.batch_memcpy()),
            "cudaMemcpyAsync": lambda: RuntimeLoopEngine(self.library.runtime()),
            "torch.copy_": TorchCopyEngine,
        }


def caches(num_blocks=16):
    g = KVGeometry(4, num_blocks, 4, 2, 16, torch.bfloat16)
    device_side = allocate_dense_kv_cache(g, LBHNC, "cpu")
    for parts in device_side.layers:
        parts[0].copy_(torch.randn(parts[0].shape))
    return device_side, allocate_dense_kv_cache(g, LBHNC, "cpu")


def test_the_entry_point_loads_and_the_probe_declines_here():
    registry = PluginRegistry(allow=None, block=())
    info = next(p for p in registry.plugins if p.name == "cuda")
    assert info.error is None and isinstance(info.plugin, CUDAPlugin)
    assert info.distribution.startswith("kvhal-cuda")
    outcome = registry.probe(info)
    if torch.version.cuda and torch.cuda.device_count():
        assert outcome.present and outcome.descriptor.name == "cuda"
    elif not torch.version.cuda:
        assert not outcome.present and "built without CUDA" in outcome.reason


def test_stores_and_loads_go_through_cu_memcpy_batch_with_the_right_order():
    library = FakeVendorLibrary()
    plugin = FakeCUDA(library)
    device_side, host = caches()
    stream = plugin.kvhal_create_stream(torch.device("cuda"))
    store = plugin.kvhal_copy_blocks(
        as_if_direction(plan_copy(device_side, host, [(3, 0), (4, 1)]), Direction.D2H), stream
    )
    load_same = as_if_direction(plan_copy(host, device_side, [(0, 9)]), Direction.H2D)
    plugin.kvhal_copy_blocks(load_same, stream)
    plugin.stream_module().complete_all()
    assert plugin.kvhal_query_event(store) is True
    plugin.kvhal_copy_blocks(load_same, stream)
    orders = [c.src_access_order for c in library.batch_calls]
    assert orders == [
        native.SRC_ACCESS_ORDER_STREAM,
        native.SRC_ACCESS_ORDER_STREAM,
        native.SRC_ACCESS_ORDER_ANY,
    ]
    assert {c.stream for c in library.batch_calls} == {stream.cuda_stream}
    assert torch.equal(get_kv_from_block(device_side, 3), get_kv_from_block(device_side, 9))


def test_a_driver_that_rejects_the_batch_call_falls_back_to_cuda_memcpy_async():
    library = FakeVendorLibrary(fail_batch=1)  # CUDA_ERROR_INVALID_VALUE, as in vllm#39491
    plugin = FakeCUDA(library)
    device_side, host = caches()
    stream = plugin.kvhal_create_stream(torch.device("cuda"))
    event = plugin.kvhal_copy_blocks(
        as_if_direction(plan_copy(device_side, host, [(5, 2)]), Direction.D2H), stream
    )
    plugin.kvhal_synchronize_event(event)
    assert len(library.batch_calls) == 1 and len(library.memcpy_calls) == 4  # one per layer
    assert plugin.engine_chain().active.name == "cudaMemcpyAsync"
    assert torch.equal(get_kv_from_block(device_side, 5), get_kv_from_block(host, 2))


def test_host_buffers_through_the_facade_hooks():
    plugin = FakeCUDA(FakeVendorLibrary())
    buffer = plugin.kvhal_allocate_host_buffer(10_000)
    assert buffer.data_ptr() % 4096 == 0 and buffer.numel() == 10_000
    assert plugin.kvhal_host_buffer_is_pinned(buffer) is True
    plugin.kvhal_free_host_buffer(buffer)
    assert plugin.kvhal_host_buffer_is_pinned(buffer) is False  # forgotten; plain memory


def test_through_the_device_facade_copies_wait_for_compute():
    registry = PluginRegistry(autoload=False, allow=None, block=())
    plugin = FakeCUDA(FakeVendorLibrary())
    registry.register(plugin, "cuda", "kvhal-cuda (test)")
    device = registry.select("cuda")
    a, b = caches()
    event = device.copy_blocks(a, b, np.array([[1, 2]]))
    module = plugin.stream_module()
    module.complete_all()
    device.synchronize_event(event)
    stream = device.default_stream
    marker = stream.waited[0]
    assert marker.stream is module.compute, "the copy stream waited on an event recorded on compute"
    assert torch.equal(get_kv_from_block(a, 1), get_kv_from_block(b, 2))


@pytest.mark.parametrize("forced", ["cudaMemcpyAsync", "torch.copy_"])
def test_a_forced_engine_is_used_alone(monkeypatch, forced):
    monkeypatch.setenv("KVHAL_CUDA_COPY_ENGINE", forced)
    plugin = FakeCUDA(FakeVendorLibrary())
    assert plugin.engine_chain().names == [forced]
    assert plugin.kvhal_probe().details["copy_engine"] == forced
