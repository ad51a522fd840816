"""The NPU probe: torch_npu absent is normal and says so."""

from __future__ import annotations

from dataclasses import replace

from kvhal.descriptor import Capability, DeviceDescriptor, Refusal
from kvhal.layouts import LBNHC
from kvhal.registry import PluginRegistry
from kvhal_npu.facts import NpuFacts, decide_npu, gather_npu_facts
from kvhal_npu.layouts import npu_kv_layouts
from kvhal_npu.plugin import NPUPlugin

ASCEND = NpuFacts(
    torch_version="2.10.0",
    torch_npu_installed=True,
    torch_npu_version="2.10.0.post4",
    device_count=16,
    pin_routes=("aclrtMallocHost", "aclrtHostRegisterV2"),
    pin_note="aclrtMallocHost, then aclrtHostRegisterV2",
)


def test_without_torch_npu_the_probe_declines():
    answer = decide_npu(NpuFacts(torch_version="2.13.0+cpu"), ["torch.copy_"], batched=False)
    assert isinstance(answer, Refusal) and "torch_npu is not installed" in answer.reason


def test_a_broken_torch_npu_declines_with_its_import_error():
    facts = NpuFacts("2.10.0", torch_npu_installed=True, import_error="ImportError: libascendcl.so")
    answer = decide_npu(facts, ["torch.copy_"], batched=False)
    assert isinstance(answer, Refusal) and "libascendcl.so" in answer.reason


def test_no_visible_npu_declines():
    answer = decide_npu(NpuFacts("2.10.0", True, "2.10.0.post4"), ["torch.copy_"], batched=False)
    assert isinstance(answer, Refusal) and "ASCEND_RT_VISIBLE_DEVICES" in answer.reason


def test_an_ascend_machine_is_described():
    d = decide_npu(ASCEND, ["vllm_ascend._C_ascend.swap_blocks_batch", "torch.copy_"], batched=True)
    assert isinstance(d, DeviceDescriptor)
    assert (d.name, d.torch_device_type, d.vendor, d.device_count) == ("npu", "npu", "huawei", 16)
    assert d.supports(Capability.SPLIT_KV) and d.supports(Capability.BATCHED_COPY)
    assert not d.supports(Capability.CROSS_LAYER), "Ascend kernels take no cross-layer layout"
    assert d.details["copy_engine"] == "vllm_ascend._C_ascend.swap_blocks_batch"


def test_pageable_host_buffers_drop_the_pinned_capability():
    engines = ["torch.copy_"]
    pinned = decide_npu(ASCEND, engines, batched=False)
    assert pinned.supports(Capability.PINNED_HOST) and "aclrtMallocHost" in pinned.details["host_pinning"]
    off = decide_npu(ASCEND, engines, batched=False, pinned_host=False)
    assert not off.supports(Capability.PINNED_HOST) and "KVHAL_PIN_HOST=off" in off.details["host_pinning"]


def test_without_an_ascendcl_pinning_call_host_pinned_is_not_declared():
    note = "no AscendCL pinning call (libascendcl.so could not be loaded)"
    facts = replace(ASCEND, pin_routes=(), pin_note=note)
    answer = decide_npu(facts, ["torch.copy_"], batched=False)
    assert not answer.supports(Capability.PINNED_HOST)
    assert answer.details["host_pinning"].startswith("pageable: no AscendCL pinning call")


def test_a_bad_pin_setting_makes_the_probe_decline_naming_it(monkeypatch):
    from kvhal_npu.plugin import NPUPlugin

    monkeypatch.setenv("KVHAL_PIN_HOST", "maybe")
    answer = NPUPlugin(facts=ASCEND).kvhal_probe()
    assert isinstance(answer, Refusal) and "KVHAL_PIN_HOST='maybe'" in answer.reason


def test_this_machine_has_no_torch_npu_and_imports_nothing_heavy():
    import sys

    facts = gather_npu_facts()
    assert not facts.torch_npu_installed
    assert "torch_npu" not in sys.modules
    answer = NPUPlugin().kvhal_probe()
    assert isinstance(answer, Refusal) and "torch_npu is not installed" in answer.reason


def test_the_entry_point_loads():
    registry = PluginRegistry(allow=None, block=())
    info = next(p for p in registry.plugins if p.name == "npu")
    assert isinstance(info.plugin, NPUPlugin) and info.distribution.startswith("kvhal-npu")


def test_every_ascend_backend_takes_lbnhc():
    for backend in (None, "ASCEND", "ASCEND_MLA", "FLASH_ATTN"):
        assert npu_kv_layouts(backend) == (LBNHC,)
    assert NPUPlugin().kvhal_kv_layouts("ASCEND") == (LBNHC,)
