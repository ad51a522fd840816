"""The ROCm probe tells HIP from CUDA and says why it declines."""

from __future__ import annotations

import pytest
import torch

from kvhal.descriptor import Capability, DeviceDescriptor, Refusal
from kvhal_cuda.facts import TorchFacts
from kvhal_rocm.batching import BatchPolicy
from kvhal_rocm.plugin import ROCmPlugin
from kvhal_rocm.probe import decide_rocm
from kvhal_rocm.versions import format_hip_version, hip_major_minor, hip_version_int

ROCM_TORCH = TorchFacts(
    torch_version="2.13.0+rocm7.1",
    hip_version="7.1.25424-4179531dcd",
    device_count=8,
    runtime_library="/opt/rocm/lib/libamdhip64.so.7",
    hip_runtime_version=71_352_340,
)
ENGINES = ["hipMemcpyBatchAsync", "hipMemcpyAsync", "torch.copy_"]


def decide(facts, **kw):
    args = {"pinned_host": True, "engines": ENGINES, "batched": True, "policy": BatchPolicy(), **kw}
    return decide_rocm(facts, **args)


def test_a_cpu_torch_declines_for_lack_of_hip():
    answer = decide(TorchFacts(torch_version="2.13.0+cpu"))
    assert isinstance(answer, Refusal) and "built without HIP" in answer.reason


def test_a_cuda_torch_is_left_to_kvhal_cuda():
    answer = decide(TorchFacts(torch_version="2.13.0+cu128", cuda_version="12.8", device_count=1))
    assert isinstance(answer, Refusal) and "CUDA build" in answer.reason and "kvhal-cuda" in answer.reason


def test_no_visible_gpu_declines():
    answer = decide(ROCM_TORCH.replace(device_count=0))
    assert isinstance(answer, Refusal) and "no ROCm GPU visible" in answer.reason


def test_a_rocm_machine_is_described_with_the_cuda_device_type():
    d = decide(ROCM_TORCH)
    assert isinstance(d, DeviceDescriptor)
    assert (d.name, d.torch_device_type, d.vendor, d.device_count) == ("rocm", "cuda", "amd", 8)
    assert d.supports(Capability.BATCHED_COPY) and d.supports(Capability.CROSS_LAYER)
    assert d.details["hip_runtime"] == "7.13.52340"
    assert d.details["batch_min_bytes"] == str(256 << 10)
    assert d.details["batch_max_descriptors"] == "8192"


@pytest.mark.skipif(bool(getattr(torch.version, "hip", None)), reason="a ROCm torch")
def test_this_machine_declines():
    answer = ROCmPlugin().kvhal_probe()
    expected = "CUDA build" if torch.version.cuda else "built without HIP"
    assert isinstance(answer, Refusal) and expected in answer.reason


def test_bad_batch_settings_decline_with_the_reason(monkeypatch):
    monkeypatch.setenv("KVHAL_ROCM_MAX_BATCH_DESCRIPTORS", "9000")
    answer = ROCmPlugin(facts=ROCM_TORCH).kvhal_probe()
    assert isinstance(answer, Refusal) and "faults" in answer.reason


@pytest.mark.parametrize(
    "text, value",
    [
        ("7.1.25424-4179531dcd", 70_125_424),
        ("6.2.41133", 60_241_133),
        ("7.13", 71_300_000),
        ("", None),
        (None, None),
        ("rocm", None),
    ],
)
def test_hip_version_strings(text, value):
    assert hip_version_int(text) == value


def test_hip_version_parts():
    assert hip_major_minor(71_300_000) == (7, 13)
    assert hip_major_minor(70_200_003) == (7, 2)
    assert format_hip_version(70_200_003) == "7.2.3" and format_hip_version(None) == "unknown"
