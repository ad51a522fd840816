"""kvhal-rocm as kvhal loads it; its KV buffers are padded to whole pages like vLLM's on ROCm;
host registration and its error clearing go through libamdhip64 (``hip*`` names)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvhal.accel.descriptors import Descriptors
from kvhal.accel.engines import CopyArgumentError, CopyJob
from kvhal.cache import dense_nbytes
from kvhal.copyplan import Direction
from kvhal.errors import ValidationError
from kvhal.geometry import KVFormat, KVGeometry
from kvhal.layouts import LBHNC
from kvhal.registry import PluginRegistry
from kvhal.testing.accel import FakeStreamModule
from kvhal_cuda import native
from kvhal_cuda.facts import TorchFacts
from kvhal_cuda.fakes import FakeRuntime
from kvhal_rocm.batching import BatchPolicy
from kvhal_rocm.plugin import KV_BUFFER_ROUNDING, ROCmPlugin, hip_batch_engine


def test_the_entry_point_loads_and_declines_here():
    registry = PluginRegistry(allow=None, block=())
    info = next(p for p in registry.plugins if p.name == "rocm")
    assert isinstance(info.plugin, ROCmPlugin) and info.distribution.startswith("kvhal-rocm")
    if not getattr(torch.version, "hip", None):
        reason = registry.probe(info).reason
        assert ("CUDA build" if torch.version.cuda else "built without HIP") in reason


def test_kv_buffers_are_rounded_up_to_4096_bytes():
    g = KVGeometry(3, 7, 16, 1, 40, torch.float16, kv_format=KVFormat.SPLIT)
    cache = ROCmPlugin().kvhal_allocate_kv_cache(g, LBHNC, torch.device("cpu"))
    (buffer,) = cache.storage
    assert dense_nbytes(g) % KV_BUFFER_ROUNDING != 0
    assert buffer.numel() % KV_BUFFER_ROUNDING == 0 and 0 <= buffer.numel() - dense_nbytes(g) < 4096
    assert cache.geometry == g and int(buffer.abs().sum()) == 0


ROCM_FACTS = TorchFacts(
    torch_version="2.13.0+rocm7.1",
    hip_version="7.1.25424",
    device_count=1,
    runtime_library="/opt/rocm/lib/libamdhip64.so.7",
    hip_runtime_version=71_300_000,
)


def fake_rocm(fake: FakeRuntime) -> ROCmPlugin:
    plugin = ROCmPlugin(facts=ROCM_FACTS, stream_module=FakeStreamModule())
    plugin.runtime_library = lambda: native.RuntimeLibrary(fake, "hip")
    return plugin


def test_host_buffers_register_through_hip_and_a_failure_is_cleared_there():
    fake = FakeRuntime("hip", register_codes=(2,))  # hipErrorOutOfMemory
    plugin = fake_rocm(fake)
    failed = plugin.kvhal_allocate_host_buffer(8192)
    assert plugin.kvhal_host_buffer_is_pinned(failed) is False
    assert [c[0] for c in fake.calls] == ["HostRegister", "GetLastError"] and fake.pending == 0
    pinned = plugin.kvhal_allocate_host_buffer(8192)
    assert plugin.kvhal_host_buffer_is_pinned(pinned) is True
    assert fake.calls[-1] == ("HostRegister", pinned.data_ptr(), 8192, native.HOST_REGISTER_PORTABLE)
    plugin.kvhal_free_host_buffer(pinned)
    assert fake.calls[-1] == ("HostUnregister", pinned.data_ptr())


def test_the_null_stream_is_refused_on_rocm_too():
    plugin = fake_rocm(FakeRuntime("hip"))
    with pytest.raises(ValidationError, match="legacy default stream") as caught:
        plugin.check_copy_stream(plugin.stream_module().default_stream())
    assert caught.value.argument == "stream"
    plugin.check_copy_stream(plugin.stream_module().Stream())  # a created stream is fine


def test_a_failed_hip_batch_is_cleared_and_one_bad_copy_keeps_the_engine():
    fake = FakeRuntime("hip", fail_batch=native.INVALID_VALUE)
    engine = hip_batch_engine(native.RuntimeLibrary(fake, "hip"), BatchPolicy(min_bytes=0))
    src = np.arange(64, dtype=np.uint8)
    dst = np.zeros_like(src)
    d = Descriptors.from_lists([src.ctypes.data], [dst.ctypes.data], [64])
    stream = FakeStreamModule().Stream()
    with pytest.raises(CopyArgumentError, match="hipMemcpyBatchAsync returned 1: failIdx=0 of 1"):
        engine.run(CopyJob(None, d, Direction.H2D, stream))  # type: ignore[arg-type]
    assert [c[0] for c in fake.calls] == ["GetLastError"] and fake.pending == 0
