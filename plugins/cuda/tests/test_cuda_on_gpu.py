"""kvhal-cuda on a real NVIDIA GPU: every copy engine, ordering after compute, pinning.

Skipped without a CUDA device. These complement the conformance suite: they
force each copy engine in turn (the suite sees only the one selected) and race
copies against compute-stream work that ``torch.cuda._sleep`` delays, so a
copy not ordered after compute would read or be overwritten by stale data.
"""

from __future__ import annotations

import pytest
import torch

from kvhal.blocks import get_kv_from_block, put_kv_into_block
from kvhal.geometry import KVFormat, KVGeometry
from kvhal.layouts import BLHNC, LBHNC
from kvhal.registry import PluginRegistry
from kvhal_cuda.engines import cuda_engine_names

pytestmark = pytest.mark.skipif(
    not (torch.version.cuda and torch.cuda.is_available()), reason="needs an NVIDIA GPU and a CUDA torch"
)

ENGINES = ["cuMemcpyBatchAsync", "vllm._C_cache_ops.swap_blocks_batch", "cudaMemcpyAsync", "torch.copy_"]
#: About 50 ms of GPU time on an H100 (1.98 GHz): long enough to lose any race.
SLEEP_CYCLES = 100_000_000


def cuda_device(monkeypatch, engine: str | None = None):
    """The kvhal device for this GPU (with only ``engine`` when given) and its plugin object."""
    registry = PluginRegistry(allow="cuda")
    plugin = next(p.plugin for p in registry.plugins if p.name == "cuda")
    if engine is not None:
        if engine not in cuda_engine_names(plugin.machine_facts()):
            pytest.skip(f"{engine} is not offered on this machine")
        monkeypatch.setenv("KVHAL_CUDA_COPY_ENGINE", engine)
    return registry.select("cuda"), plugin


def pinned_host_cache(device, plugin, g, layout, num_blocks):
    """A host cache whose buffer registration has finished, so copies to it are asynchronous."""
    host = device.allocate_host_cache(g, layout, num_blocks)
    for buffer in host.storage:
        assert plugin.host_buffers().wait(buffer)
    return host


def geometry(num_blocks: int = 64, kv_format: KVFormat = KVFormat.STACKED) -> KVGeometry:
    return KVGeometry(8, num_blocks, 16, 8, 128, torch.bfloat16, kv_format=kv_format)


def same(a, b) -> bool:
    pairs = zip(a, b, strict=True) if isinstance(a, tuple) else [(a, b)]
    return all(torch.equal(x.cpu(), y.cpu()) for x, y in pairs)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("layout", [LBHNC, BLHNC], ids=str)
def test_store_and_load_round_trip_through_each_engine(monkeypatch, engine, layout):
    device, plugin = cuda_device(monkeypatch, engine)
    g = geometry()
    cache = device.allocate_kv_cache(g, layout)
    for parts in cache.layers:
        parts[0].copy_(torch.randn(parts[0].shape, device="cuda"))
    host = pinned_host_cache(device, plugin, g, layout, 32)
    mapping = [(5, 0), (6, 1), (7, 2), (40, 10), (63, 31)]
    device.synchronize_event(device.copy_blocks(cache, host, mapping))
    for s, d in mapping:
        assert same(get_kv_from_block(cache, s), get_kv_from_block(host, d))
    back = [(0, 20), (1, 21), (10, 3), (31, 0)]
    device.synchronize_event(device.copy_blocks(host, cache, back))
    for s, d in back:
        assert same(get_kv_from_block(host, s), get_kv_from_block(cache, d))
    device.free_host_cache(host)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_store_reads_what_compute_wrote_even_when_compute_is_late(monkeypatch, engine):
    device, plugin = cuda_device(monkeypatch, engine)
    g = geometry()
    cache = device.allocate_kv_cache(g, LBHNC)
    host = pinned_host_cache(device, plugin, g, LBHNC, 4)
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)  # compute is busy...
    for parts in cache.layers:
        parts[0][3].fill_(7.0)  # ...then writes block 3
    event = device.copy_blocks(cache, host, [(3, 0)])  # issued before compute finished
    device.synchronize_event(event)
    assert all(bool((parts[0][0] == 7.0).all()) for parts in host.layers)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_load_lands_after_compute_zeroed_its_destination(monkeypatch, engine):
    device, plugin = cuda_device(monkeypatch, engine)
    g = geometry()
    cache = device.allocate_kv_cache(g, LBHNC)
    host = pinned_host_cache(device, plugin, g, LBHNC, 4)
    for parts in host.layers:
        parts[0][1].fill_(3.0)
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    for parts in cache.layers:
        parts[0][9].zero_()  # the engine zeroing a block it will load into (vLLM #50696)
    device.synchronize_event(device.copy_blocks(host, cache, [(1, 9)]))
    assert all(bool((parts[0][9] == 3.0).all()) for parts in cache.layers)


def test_a_load_right_after_a_store_into_its_source_sees_the_stored_bytes(monkeypatch):
    device, plugin = cuda_device(monkeypatch)
    g = geometry()
    cache = device.allocate_kv_cache(g, LBHNC)
    host = pinned_host_cache(device, plugin, g, LBHNC, 4)
    for parts in cache.layers:
        parts[0][2].fill_(5.0)
    torch.cuda._sleep(SLEEP_CYCLES)
    stream = device.create_stream()
    device.copy_blocks(cache, host, [(2, 0)], stream)  # still pending when the load is issued
    event = device.copy_blocks(host, cache, [(0, 11)], stream)  # must not read host block 0 early
    device.synchronize_event(event)
    assert all(bool((parts[0][11] == 5.0).all()) for parts in cache.layers)


def test_split_caches_copy(monkeypatch):
    device, plugin = cuda_device(monkeypatch)
    g = geometry(kv_format=KVFormat.SPLIT)
    cache = device.allocate_kv_cache(g, LBHNC)
    k = torch.randn(8, 8, 16, 128, device="cuda").to(torch.bfloat16)
    put_kv_into_block(cache, 4, (k, k * 2))
    host = pinned_host_cache(device, plugin, g, LBHNC, 2)
    device.synchronize_event(device.copy_blocks(cache, host, [(4, 1)]))
    assert same(get_kv_from_block(host, 1), (k, k * 2))


def test_host_buffers_get_registered_and_released(monkeypatch):
    device, plugin = cuda_device(monkeypatch)
    buffer = device.allocate_host_buffer(64 << 20)
    assert plugin.host_buffers().wait(buffer) is True
    assert device.host_buffer_is_pinned(buffer) and buffer.is_pinned()
    device.free_host_buffer(buffer)
    assert not buffer.is_pinned()


def test_the_runtime_witness_sees_registered_buffers_and_not_pageable_ones(monkeypatch):
    """cudaPointerGetAttributes: host (1) inside a registered buffer, up to gigabytes; not for a
    plain tensor or a freed buffer; torch's own pinned memory is host too."""
    device, plugin = cuda_device(monkeypatch)
    (witness,) = plugin.kvhal_pinning_witnesses()
    assert witness.unavailable() is None
    for nbytes in (4096, (16 << 20) + 3, (2 << 30) + (64 << 20)):
        buffer = device.allocate_host_buffer(nbytes)
        seen = witness.witness(buffer.data_ptr(), nbytes)
        assert seen.pinned, seen.how
        device.free_host_buffer(buffer)
        assert witness.witness(buffer.data_ptr(), nbytes).unpinned_at == 0
    plain = torch.zeros(1 << 20, dtype=torch.uint8)
    assert not witness.witness(plain.data_ptr(), 1 << 20).pinned
    pinned = torch.zeros(1 << 20, dtype=torch.uint8, pin_memory=True)
    assert witness.witness(pinned.data_ptr(), 1 << 20).pinned


@pytest.mark.parametrize("engine", ENGINES)
def test_copies_spanning_registration_chunks_round_trip(monkeypatch, engine):
    device, plugin = cuda_device(monkeypatch, engine)
    plugin.host_buffers().max_chunk = 1 << 20  # many registrations, so runs of blocks cross them
    g = geometry()
    cache = device.allocate_kv_cache(g, LBHNC)
    for parts in cache.layers:
        parts[0].copy_(torch.randn(parts[0].shape, device="cuda"))
    host = pinned_host_cache(device, plugin, g, LBHNC, 64)
    assert len(plugin.host_buffers().boundaries()) > 0
    mapping = [(i, i) for i in range(64)]
    device.synchronize_event(device.copy_blocks(cache, host, mapping))
    back = [(i, (i + 7) % 64) for i in range(64)]
    device.synchronize_event(device.copy_blocks(host, cache, back))
    for s, d in back:
        assert same(get_kv_from_block(host, s), get_kv_from_block(cache, d))
    device.free_host_cache(host)


def test_the_legacy_default_stream_is_refused(monkeypatch):
    from kvhal.errors import PluginValidationError

    device, plugin = cuda_device(monkeypatch)
    g = geometry()
    cache = device.allocate_kv_cache(g, LBHNC)
    host = pinned_host_cache(device, plugin, g, LBHNC, 4)
    with pytest.raises(PluginValidationError, match="legacy default stream"):
        device.copy_blocks(cache, host, [(0, 0)], stream=torch.cuda.default_stream())
    device.free_host_cache(host)


def test_a_failed_registration_leaves_no_pending_error(monkeypatch):
    _, plugin = cuda_device(monkeypatch)
    runtime = plugin.runtime_library()
    buffer = torch.zeros(1 << 20, dtype=torch.int8)
    address = buffer.data_ptr() // 4096 * 4096 + 4096
    assert runtime.host_register(address, 4096) == 0
    assert runtime.host_register(address, 4096) != 0  # already registered
    assert runtime.clear_error() == 0, "host_register left its error pending"
    (torch.ones(4, device="cuda") * 2).sum().item()  # torch sees no stale error
    assert runtime.host_unregister(address) == 0
