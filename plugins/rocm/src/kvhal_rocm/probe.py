"""Whether this is a ROCm machine kvhal-rocm serves: a pure decision over :class:`TorchFacts`.

HIP and CUDA builds of torch share ``torch.cuda``; ``torch.version.hip`` tells
them apart (PyTorch's HIP notes; vLLM ``platforms/__init__.py``).
"""

from __future__ import annotations

from kvhal.descriptor import DeviceDescriptor, Refusal
from kvhal_cuda.facts import TorchFacts
from kvhal_cuda.probe import gpu_descriptor
from kvhal_rocm.batching import BatchPolicy
from kvhal_rocm.versions import format_hip_version


def decide_rocm(
    facts: TorchFacts, *, pinned_host: bool, engines: list[str], batched: bool, policy: BatchPolicy
) -> DeviceDescriptor | Refusal:
    """The ROCm probe's answer."""
    if not facts.hip_version:
        if facts.cuda_version:
            return Refusal(
                f"torch {facts.torch_version} is a CUDA build (torch.version.cuda={facts.cuda_version}), "
                "not HIP; kvhal-cuda serves it"
            )
        return Refusal(
            f"torch {facts.torch_version} was built without HIP (torch.version.hip is None); "
            "install a ROCm build of torch"
        )
    if facts.device_count < 1:
        return Refusal(
            f"no ROCm GPU visible (torch.cuda.device_count() is 0 with torch {facts.torch_version}, "
            f"HIP {facts.hip_version}; check the amdgpu driver and HIP_VISIBLE_DEVICES)"
        )
    # ROCm torch reuses the "cuda" device type.
    return gpu_descriptor(
        "rocm",
        "amd",
        facts,
        pinned_host=pinned_host,
        engines=engines,
        batched=batched,
        details={
            "torch.version.hip": facts.hip_version,
            "hip_runtime": format_hip_version(facts.hip_runtime_version),
            "batch_min_bytes": str(policy.min_bytes),
            "batch_max_descriptors": str(policy.max_descriptors),
        },
    )
