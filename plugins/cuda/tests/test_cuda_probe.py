"""The CUDA probe's decisions, from hand-made torch facts."""

from __future__ import annotations

import pytest
import torch

from kvhal.descriptor import Capability, DeviceDescriptor, Refusal
from kvhal_cuda.facts import TorchFacts, gather_torch_facts
from kvhal_cuda.plugin import CUDAPlugin
from kvhal_cuda.probe import decide_cuda, format_cuda_version, gpu_descriptor

CPU_TORCH = TorchFacts(torch_version="2.13.0+cpu")
CUDA_TORCH = TorchFacts(
    torch_version="2.13.0+cu128",
    cuda_version="12.8",
    device_count=8,
    driver_version=12090,
    runtime_library="/x/libcudart.so.12",
)
ENGINES = ["cuMemcpyBatchAsync", "cudaMemcpyAsync", "torch.copy_"]


def decide(facts, **kw):
    args = {"pinned_host": True, "engines": ENGINES, "batched": True, **kw}
    return decide_cuda(facts, **args)


def test_a_torch_built_without_cuda_declines_saying_so():
    answer = decide(CPU_TORCH)
    assert isinstance(answer, Refusal)
    assert "built without CUDA" in answer.reason and "2.13.0+cpu" in answer.reason


def test_a_hip_build_is_left_to_kvhal_rocm():
    answer = decide(CUDA_TORCH.replace(cuda_version=None, hip_version="7.1.25424"))
    assert isinstance(answer, Refusal)
    assert "ROCm/HIP build" in answer.reason and "kvhal-rocm" in answer.reason


def test_no_visible_device_declines():
    answer = decide(CUDA_TORCH.replace(device_count=0))
    assert isinstance(answer, Refusal)
    assert "no CUDA device visible" in answer.reason and "CUDA_VISIBLE_DEVICES" in answer.reason


def test_a_cuda_machine_is_described():
    d = decide(CUDA_TORCH)
    assert isinstance(d, DeviceDescriptor)
    assert (d.name, d.torch_device_type, d.vendor, d.priority, d.device_count) == (
        "cuda",
        "cuda",
        "nvidia",
        100,
        8,
    )
    for cap in (Capability.CROSS_LAYER, Capability.SPLIT_KV, Capability.ASYNC_COPY, Capability.FP8):
        assert d.supports(cap)
    assert d.supports(Capability.PINNED_HOST) and d.supports(Capability.BATCHED_COPY)
    assert d.details["copy_engine"] == "cuMemcpyBatchAsync"
    assert d.details["copy_engine_fallbacks"] == "cudaMemcpyAsync, torch.copy_"
    assert d.details["driver"] == "12.9"


def test_raw_bytes_are_declared_for_cuda_and_not_for_the_shared_gpu_base():
    """dtype.uint8 (K and V of different dtypes, as uint8 rows) is kvhal-cuda's: verified by its
    conformance run on a GPU; kvhal-rocm, built on the same descriptor, does not inherit it."""
    assert decide(CUDA_TORCH).supports("dtype.uint8")
    base = gpu_descriptor("x", "y", CUDA_TORCH, pinned_host=True, engines=ENGINES, batched=True, details={})
    assert not base.supports("dtype.uint8")


def test_capabilities_follow_pinning_and_batching():
    d = decide(CUDA_TORCH, pinned_host=False, batched=False, engines=["torch.copy_"])
    assert not d.supports(Capability.PINNED_HOST) and not d.supports(Capability.BATCHED_COPY)
    assert d.details["copy_engine_fallbacks"] == "none"


@pytest.mark.parametrize(
    "version, text", [(12080, "12.8"), (13000, "13.0"), (12020, "12.2"), (None, "unknown")]
)
def test_format_cuda_version(version, text):
    assert format_cuda_version(version) == text


@pytest.mark.skipif(bool(torch.version.cuda), reason="checks how a CPU-only torch is declined")
def test_this_machine_declines_without_touching_a_device():
    facts = gather_torch_facts()
    assert facts.cuda_version is None and facts.device_count == 0
    answer = CUDAPlugin().kvhal_probe()
    assert isinstance(answer, Refusal) and "built without CUDA" in answer.reason


def test_a_bad_forced_engine_declines_with_the_reason(monkeypatch):
    monkeypatch.setenv("KVHAL_CUDA_COPY_ENGINE", "warp-drive")
    answer = CUDAPlugin(facts=CUDA_TORCH).kvhal_probe()
    assert isinstance(answer, Refusal) and "KVHAL_CUDA_COPY_ENGINE='warp-drive'" in answer.reason


def test_a_bad_pin_setting_declines_with_the_reason(monkeypatch):
    monkeypatch.setenv("KVHAL_PIN_HOST", "maybe")
    answer = CUDAPlugin(facts=CUDA_TORCH).kvhal_probe()
    assert isinstance(answer, Refusal) and "KVHAL_PIN_HOST" in answer.reason
