"""vllm-ascend loads its ops lazily (``vllm_ascend.utils.enable_custom_op()``): the probe loads
them before looking, and the first copy looks again. A fake ``vllm_ascend`` stands in here."""

from __future__ import annotations

import ctypes
import sys
import types
from dataclasses import replace

import pytest
import torch

from kvhal.blocks import get_kv_from_block
from kvhal.copyplan import Direction, plan_copy
from kvhal.descriptor import Capability
from kvhal.geometry import KVFormat, KVGeometry
from kvhal.layouts import LBNHC
from kvhal.testing.accel import FakeStreamModule, as_if_direction
from kvhal_npu.allocation import allocate_aligned_kv_cache
from kvhal_npu.engines import ASCEND_SWAP_BLOCKS_BATCH, TORCH_COPY
from kvhal_npu.facts import NpuFacts, ascend_op_registered, find_ascend_op
from kvhal_npu.host_memory import PinnedHostBuffers
from kvhal_npu.plugin import NPUPlugin

# The probe ran before vllm-ascend loaded its ops: it saw none.
EARLY = NpuFacts("2.10.0", True, "2.10.0.post4", device_count=1, pin_routes=("aclrtMallocHost",))


class FakeVllmAscend:
    """``vllm_ascend.utils.enable_custom_op`` that registers ``_C_ascend::swap_blocks_batch`` (CPU)."""

    def __init__(self, result: bool = True, error: Exception | None = None) -> None:
        self.result, self.error = result, error
        self.calls = 0
        self.seen: list[tuple] = []
        self.libs: list[torch.library.Library] = []

    def enable_custom_op(self) -> bool:
        self.calls += 1
        if self.error is not None:
            raise self.error
        if self.result and not self.libs:
            self.load()
        return self.result

    def load(self) -> None:
        lib = torch.library.Library("_C_ascend", "DEF")
        lib.define("swap_blocks_batch(Tensor x, Tensor y, Tensor z, int direction) -> ()")

        def impl(x, y, z, direction):
            self.seen.append((direction,))
            for s, d, n in zip(x.tolist(), y.tolist(), z.tolist(), strict=True):
                ctypes.memmove(d, s, n)

        lib.impl("swap_blocks_batch", impl, "CPU")
        self.libs.append(lib)


@pytest.fixture
def vllm_ascend(monkeypatch):
    fake = FakeVllmAscend()
    package, utils = types.ModuleType("vllm_ascend"), types.ModuleType("vllm_ascend.utils")
    utils.enable_custom_op = fake.enable_custom_op
    package.utils = utils
    monkeypatch.setitem(sys.modules, "vllm_ascend", package)
    monkeypatch.setitem(sys.modules, "vllm_ascend.utils", utils)
    yield fake
    for lib in fake.libs:
        lib._destroy()
    assert not ascend_op_registered()


def test_the_probe_loads_vllm_ascends_ops_before_looking(vllm_ascend):
    assert not ascend_op_registered(), "not registered until vllm-ascend loads it"
    assert find_ascend_op() == (True, None)
    assert vllm_ascend.calls == 1 and ascend_op_registered()
    assert find_ascend_op() == (True, None) and vllm_ascend.calls == 1, "a registered op needs no loading"


def test_without_vllm_ascend_the_op_is_absent_and_says_why():
    assert "vllm_ascend" not in sys.modules
    assert find_ascend_op() == (False, "vllm-ascend is not installed")


def test_disabled_or_broken_custom_ops_are_reported(vllm_ascend):
    vllm_ascend.result = False
    found, why = find_ascend_op()
    assert not found and "enable_custom_op() returned False" in why
    vllm_ascend.error = ImportError("libcust_opapi.so: cannot open shared object file")
    found, why = find_ascend_op()
    assert not found and "raised ImportError: libcust_opapi.so" in why


def test_the_probe_reports_the_op_that_loading_made_available(vllm_ascend):
    answer = NPUPlugin(facts=EARLY).kvhal_probe()
    assert answer.details["copy_engine"] == ASCEND_SWAP_BLOCKS_BATCH
    assert answer.supports(Capability.BATCHED_COPY) and "ascend_op" not in answer.details


def test_an_absent_op_is_shown_with_its_reason(vllm_ascend):
    vllm_ascend.result = False
    answer = NPUPlugin(facts=EARLY).kvhal_probe()
    assert answer.details["copy_engine"] == TORCH_COPY and not answer.supports(Capability.BATCHED_COPY)
    assert "enable_custom_op() returned False" in answer.details["ascend_op"]


def store_block(plugin: NPUPlugin) -> None:
    g = KVGeometry(2, 4, 16, 2, 32, torch.float16, kv_format=KVFormat.SPLIT)
    device_side, host = allocate_aligned_kv_cache(g, LBNHC, "cpu"), allocate_aligned_kv_cache(g, LBNHC, "cpu")
    for parts in device_side.layers:
        for view in parts:
            view.copy_(torch.randn(view.shape))
    stream = plugin.kvhal_create_stream(torch.device("privateuseone"))
    event = plugin.kvhal_copy_blocks(
        as_if_direction(plan_copy(device_side, host, [(2, 1)]), Direction.D2H), stream
    )
    plugin.kvhal_synchronize_event(event)
    k0, v0 = get_kv_from_block(device_side, 2)
    k1, v1 = get_kv_from_block(host, 1)
    assert torch.equal(k0, k1) and torch.equal(v0, v1)


def plugin_after_an_early_probe(**kw) -> NPUPlugin:
    return NPUPlugin(facts=EARLY, stream_module=FakeStreamModule(), host=PinnedHostBuffers(pin=False), **kw)


def test_an_op_loaded_after_the_probe_is_used_from_the_first_copy(vllm_ascend):
    plugin = plugin_after_an_early_probe()
    vllm_ascend.load()  # vllm-ascend's worker loads its ops after kvhal's probe
    store_block(plugin)
    assert vllm_ascend.seen == [(1,)], "one batched D2H call, through the op"
    assert plugin.engine_chain().active.name == ASCEND_SWAP_BLOCKS_BATCH


def test_without_looking_again_the_late_op_is_not_used(vllm_ascend):
    """Negative control: with the first-copy look disabled, the early 'absent' sticks."""
    plugin = plugin_after_an_early_probe(find_op=lambda: (False, "not looked for"))
    vllm_ascend.load()
    store_block(plugin)
    assert vllm_ascend.seen == [] and plugin.engine_chain().active.name == TORCH_COPY


def test_facts_that_saw_the_op_are_not_looked_at_again(vllm_ascend):
    looked = []
    plugin = NPUPlugin(facts=replace(EARLY, ascend_op=True), find_op=lambda: looked.append(1) or (True, None))
    assert plugin.engine_names()[0] == ASCEND_SWAP_BLOCKS_BATCH and looked == []
