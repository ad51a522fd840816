"""kvhal-cuda as kvhal loads it, and its copy path end to end over host memory."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvhal.accel.host_buffers import PinMode
from kvhal.blocks import get_kv_from_block
from kvhal.cache import allocate_dense_kv_cache, dense_kv_cache
from kvhal.copyplan import Direction, plan_copy
from kvhal.descriptor import Capability
from kvhal.errors import PluginValidationError, ValidationError
from kvhal.geometry import KVGeometry
from kvhal.layouts import BLHNC, LBHNC
from kvhal.registry import PluginRegistry
from kvhal.testing.accel import FakeStreamModule, as_if_direction
from kvhal_cuda import native
from kvhal_cuda.engines import BatchEngine, RuntimeLoopEngine, TorchCopyEngine
from kvhal_cuda.facts import TorchFacts
from kvhal_cuda.fakes import FakeRuntime, FakeVendorLibrary
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
    """CUDAPlugin with a fake torch.cuda, a fake libcudart and a fake cuMemcpyBatchAsync.

    :param max_chunk: the registrar's largest single registration.
    """

    def __init__(self, library: FakeVendorLibrary, max_chunk: int = 64 << 30) -> None:
        self.library = library
        self.registered: list[tuple[int, int]] = []
        registrar = HostRegistrar(
            lambda a, n: self.registered.append((a, n)) or 0, lambda a: 0, PinMode.SYNC, max_chunk=max_chunk
        )
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


class WholeCallRejected(FakeVendorLibrary):
    """A batch entry point that fails as a whole (names no copy), as an ABI mismatch does (vllm#39491)."""

    def _batch_impl(self, dsts, srcs, sizes, count, *rest) -> int:
        self.batch_calls.append(count)
        return native.INVALID_VALUE


def store(plugin, device_side, host, pairs):
    stream = plugin.kvhal_create_stream(torch.device("cuda"))
    plan = as_if_direction(plan_copy(device_side, host, pairs), Direction.D2H)
    event = plugin.kvhal_copy_blocks(plan, stream)
    plugin.kvhal_synchronize_event(event)


def test_a_batch_call_rejected_as_a_whole_drops_the_engine_for_cuda_memcpy_async():
    library = WholeCallRejected()
    plugin = FakeCUDA(library)
    device_side, host = caches()
    store(plugin, device_side, host, [(5, 2)])
    assert len(library.batch_calls) == 1 and len(library.memcpy_calls) == 4  # one per layer
    assert plugin.engine_chain().active.name == "cudaMemcpyAsync"
    assert torch.equal(get_kv_from_block(device_side, 5), get_kv_from_block(host, 2))
    store(plugin, device_side, host, [(6, 3)])
    assert len(library.batch_calls) == 1, "a dropped engine is not tried again"


def test_a_batch_call_rejecting_one_copy_keeps_the_engine_for_later_jobs():
    library = FakeVendorLibrary(fail_batch=native.INVALID_VALUE)  # names its last copy
    plugin = FakeCUDA(library)
    device_side, host = caches()
    store(plugin, device_side, host, [(5, 2)])
    chain = plugin.engine_chain()
    assert torch.equal(get_kv_from_block(device_side, 5), get_kv_from_block(host, 2))
    assert len(library.memcpy_calls) == 4, "this job ran on the next engine"
    assert chain.active.name == "cudaMemcpyBatchAsync" and chain.dropped == []
    assert chain.argument_failures == {"cudaMemcpyBatchAsync": 1}
    library.fail_batch = 0
    store(plugin, device_side, host, [(6, 3)])
    assert len(library.batch_calls) == 2 and len(library.memcpy_calls) == 4, "the next job used the batch"
    assert torch.equal(get_kv_from_block(device_side, 6), get_kv_from_block(host, 3))


def test_the_legacy_default_stream_is_refused_before_anything_is_enqueued():
    library = FakeVendorLibrary()
    plugin = FakeCUDA(library)
    device_side, host = caches()
    module = plugin.stream_module()
    plan = as_if_direction(plan_copy(device_side, host, [(5, 2)]), Direction.D2H)
    refusal = "kvhal_copy_blocks refuses the legacy default stream"
    with pytest.raises(ValidationError, match=refusal) as caught:
        plugin.kvhal_copy_blocks(plan, module.default_stream())
    assert caught.value.argument == "stream"
    assert library.batch_calls == [] and library.memcpy_calls == [] and module.events == []
    assert int(host.storage[0].count_nonzero()) == 0


def test_through_the_facade_the_refusal_names_plugin_hook_and_argument():
    registry = PluginRegistry(autoload=False, allow=None, block=())
    plugin = FakeCUDA(FakeVendorLibrary())
    registry.register(plugin, "cuda", "kvhal-cuda (test)")
    device = registry.select("cuda")
    a, b = caches()
    with pytest.raises(PluginValidationError) as caught:
        device.copy_blocks(a, b, [(1, 2)], stream=plugin.stream_module().default_stream())
    error = caught.value
    assert (error.plugin, error.hook, error.argument) == ("cuda", "kvhal_copy_blocks", "stream")


def test_copies_are_cut_where_two_host_registrations_meet():
    g = KVGeometry(2, 16, 4, 2, 16, torch.bfloat16)  # 1 KiB blocks, cross-layer (BLHNC)
    chunk = 4096
    for max_chunk, expected_pieces in ((64 << 30, 1), (chunk, 4)):  # the first is the control
        library = FakeVendorLibrary()
        plugin = FakeCUDA(library, max_chunk=max_chunk)
        buffer = plugin.kvhal_allocate_host_buffer(16 * 1024)
        host = dense_kv_cache(g, BLHNC, buffer)
        device_side = allocate_dense_kv_cache(g, BLHNC, "cpu")
        device_side.storage[0].copy_(torch.randint(-128, 127, device_side.storage[0].shape, dtype=torch.int8))
        pairs = [(i, i) for i in range(16)]  # one run: one coalesced descriptor of 16 KiB
        store(plugin, device_side, host, pairs)
        (call,) = library.batch_calls
        assert call.count == expected_pieces and sum(call.sizes) == 16 * 1024
        ends = np.cumsum(call.sizes)[:-1] + buffer.data_ptr()
        assert ends.tolist() == [a for a, _ in plugin.registered[1:]], "pieces end where registrations meet"
        assert torch.equal(host.storage[0][: 16 * 1024], device_side.storage[0])
        plugin.kvhal_free_host_buffer(buffer)


def test_host_registration_through_the_runtime_clears_a_failed_chunks_error_and_rolls_back():
    fake = FakeRuntime(register_codes=(0, 0, 2))
    plugin = CUDAPlugin(facts=FACTS, stream_module=FakeStreamModule())
    plugin.runtime_library = lambda: native.RuntimeLibrary(fake, "cuda")
    registrar = plugin.host_buffers()
    registrar.max_chunk = 4096
    buffer = plugin.kvhal_allocate_host_buffer(3 * 4096)
    base = buffer.data_ptr()
    assert plugin.kvhal_host_buffer_is_pinned(buffer) is False
    assert fake.calls == [
        ("HostRegister", base, 4096, native.HOST_REGISTER_PORTABLE),
        ("HostRegister", base + 4096, 4096, native.HOST_REGISTER_PORTABLE),
        ("HostRegister", base + 8192, 4096, native.HOST_REGISTER_PORTABLE),
        ("GetLastError",),
        ("HostUnregister", base + 4096),
        ("HostUnregister", base),
    ]
    assert fake.pending == 0, "no error is left for torch to report against a later call"
    plugin.kvhal_free_host_buffer(buffer)
    assert plugin.stream_module().log[-1] == ("device_synchronize", 0), "freeing drained the device"


def test_without_a_runtime_library_nothing_is_pinned_and_the_probe_says_so(caplog):
    plugin = CUDAPlugin(facts=FACTS.replace(runtime_library=None), stream_module=FakeStreamModule())
    assert not plugin.kvhal_probe().supports(Capability.PINNED_HOST)
    buffer = plugin.kvhal_allocate_host_buffer(4096)
    assert plugin.kvhal_host_buffer_is_pinned(buffer) is False
    assert "host buffers stay pageable" in caplog.text


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
