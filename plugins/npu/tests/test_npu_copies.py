"""The NPU's copy engines: vllm-ascend's op (with its direction codes) or Tensor.copy_."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from kvhal.accel.descriptors import Descriptors
from kvhal.accel.engines import CopyJob
from kvhal.blocks import get_kv_from_block
from kvhal.copyplan import Direction, plan_copy
from kvhal.geometry import KVFormat, KVGeometry
from kvhal.layouts import LBNHC
from kvhal.testing.accel import FakeStreamModule, as_if_direction
from kvhal_npu.allocation import allocate_aligned_kv_cache
from kvhal_npu.engines import (
    ASCEND_SWAP_BLOCKS_BATCH,
    TORCH_COPY,
    AscendSwapBlocksBatchEngine,
    npu_engine_names,
)
from kvhal_npu.facts import NpuFacts
from kvhal_npu.host_memory import PinnedHostBuffers
from kvhal_npu.plugin import NPUPlugin

FACTS = NpuFacts("2.10.0", True, "2.10.0.post4", device_count=1, ascend_op=True)


def test_engines_offered():
    assert npu_engine_names(FACTS) == [ASCEND_SWAP_BLOCKS_BATCH, TORCH_COPY]
    assert npu_engine_names(NpuFacts("2.10.0", True, "x", device_count=1)) == [TORCH_COPY]
    assert npu_engine_names(FACTS, forced=TORCH_COPY) == [TORCH_COPY]
    with pytest.raises(ValueError, match="KVHAL_NPU_COPY_ENGINE"):
        npu_engine_names(FACTS, forced="aclrtMemcpy")


def ascend_op(namespace: str, schema: str):
    seen = []
    lib = torch.library.Library(namespace, "DEF")
    lib.define(schema)

    def impl(x, y, z, *direction):
        seen.append(direction)
        for s, d, n in zip(x.tolist(), y.tolist(), z.tolist(), strict=True):
            ctypes.memmove(d, s, n)

    lib.impl("swap_blocks_batch", impl, "CPU")
    return getattr(torch.ops, namespace).swap_blocks_batch, seen, lib


def job(direction):
    src = np.arange(64, dtype=np.uint8)
    dst = np.zeros(64, dtype=np.uint8)
    d = Descriptors.from_lists([src.ctypes.data], [dst.ctypes.data + 8], [16])
    return CopyJob(None, d, direction, None), src, dst  # type: ignore[arg-type]


@pytest.mark.parametrize("direction, code", [(Direction.H2D, 0), (Direction.D2H, 1), (Direction.D2D, 2)])
def test_the_op_gets_vllm_ascends_direction_codes(direction, code):
    op, seen, _lib = ascend_op(
        f"kvhal_test_ascend_{code}", "swap_blocks_batch(Tensor x, Tensor y, Tensor z, int direction) -> ()"
    )
    (j, src, dst) = job(direction)
    AscendSwapBlocksBatchEngine(op).run(j)
    assert seen == [(code,)] and np.array_equal(dst[8:24], src[:16])


def test_a_three_tensor_op_gets_no_direction():
    op, seen, _lib = ascend_op(
        "kvhal_test_ascend_v3", "swap_blocks_batch(Tensor x, Tensor y, Tensor z) -> ()"
    )
    (j, src, dst) = job(Direction.D2H)
    engine = AscendSwapBlocksBatchEngine(op)
    engine.run(j)
    assert not engine.takes_direction and seen == [()]
    assert np.array_equal(dst[8:24], src[:16])


def test_host_to_host_has_no_direction_code():
    op, _, _lib = ascend_op(
        "kvhal_test_ascend_h2h", "swap_blocks_batch(Tensor x, Tensor y, Tensor z, int direction) -> ()"
    )
    with pytest.raises(ValueError, match="h2h"):
        AscendSwapBlocksBatchEngine(op).run(job(Direction.H2H)[0])


class FakeNPU(NPUPlugin):
    def __init__(self, op) -> None:
        self.op = op
        super().__init__(
            facts=FACTS,
            stream_module=FakeStreamModule(),
            host=PinnedHostBuffers(pin=False, drain=lambda: None),
        )

    def engine_factories(self):
        return {ASCEND_SWAP_BLOCKS_BATCH: lambda: AscendSwapBlocksBatchEngine(self.op)}


def test_a_store_runs_vllm_ascends_op_inside_the_copy_stream():
    op, seen, _lib = ascend_op(
        "kvhal_test_ascend_plugin", "swap_blocks_batch(Tensor x, Tensor y, Tensor z, int direction) -> ()"
    )
    plugin = FakeNPU(op)
    g = KVGeometry(2, 4, 16, 2, 32, torch.float16, kv_format=KVFormat.SPLIT)
    device_side, host = allocate_aligned_kv_cache(g, LBNHC, "cpu"), allocate_aligned_kv_cache(g, LBNHC, "cpu")
    for parts in device_side.layers:
        for view in parts:
            view.copy_(torch.randn(view.shape))
    stream = plugin.kvhal_create_stream(torch.device("privateuseone"))  # "npu" once torch_npu renames it
    event = plugin.kvhal_copy_blocks(
        as_if_direction(plan_copy(device_side, host, [(2, 1)]), Direction.D2H), stream
    )
    plugin.kvhal_synchronize_event(event)
    assert seen == [(1,)]
    k0, v0 = get_kv_from_block(device_side, 2)
    k1, v1 = get_kv_from_block(host, 1)
    assert torch.equal(k0, k1) and torch.equal(v0, v1)


def test_pageable_host_buffers_are_aligned_zeroed_and_drained_on_free():
    drained = []
    host = PinnedHostBuffers(pin=False, drain=lambda: drained.append(1))
    buffer = host.allocate(5000)
    assert buffer.data_ptr() % 4096 == 0 and buffer.numel() == 5000 and int(buffer.abs().sum()) == 0
    assert host.is_pinned(buffer) is False
    host.free(buffer)
    assert drained == [1], "a copy from pageable memory may still be queued"


@pytest.mark.filterwarnings("ignore:KVHAL_PIN_HOST=async is deprecated:FutureWarning")
@pytest.mark.parametrize(
    ("value", "pinned"), [("off", False), (" OFF ", False), ("sync", True), ("async", True), ("", True)]
)
def test_pin_host_setting_is_read_as_kvhal_cuda_reads_it(monkeypatch, value, pinned):
    monkeypatch.setenv("KVHAL_PIN_HOST", value)
    plugin = NPUPlugin(facts=FACTS, stream_module=FakeStreamModule())
    assert plugin.host_buffers().pin is pinned


def test_an_unknown_pin_host_setting_is_an_error_naming_it(monkeypatch):
    monkeypatch.setenv("KVHAL_PIN_HOST", "maybe")
    plugin = NPUPlugin(facts=FACTS, stream_module=FakeStreamModule())
    with pytest.raises(ValueError, match="KVHAL_PIN_HOST='maybe' is not one of async, sync, off"):
        plugin.host_buffers()
