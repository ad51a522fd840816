"""Whether this is a CUDA machine kvhal-cuda serves: a pure decision over :class:`TorchFacts`."""

from __future__ import annotations

from collections.abc import Mapping

from kvhal.accel.engines import engine_details
from kvhal.descriptor import Capability, DeviceDescriptor, Refusal
from kvhal_cuda.facts import TorchFacts

#: What every torch.cuda-driven plugin can do regardless of the machine.
GPU_CAPABILITIES = frozenset(
    {
        Capability.CROSS_LAYER,
        Capability.SPLIT_KV,
        Capability.ASYNC_COPY,
        Capability.OVERLAPPED_COPY,
        Capability.FP8,
    }
)


#: Raw bytes (``dtype_capability(torch.uint8)``): kvhal.vllm moves K and V of different dtypes
#: as uint8 rows. kvhal-cuda's engines copy byte runs, whatever the dtype.
UINT8 = "dtype.uint8"


def gpu_capabilities(
    pinned_host: bool, batched_copy: bool, extra: frozenset[str] = frozenset()
) -> frozenset[str]:
    caps: set[str] = set(GPU_CAPABILITIES) | set(extra)
    if pinned_host:
        caps.add(Capability.PINNED_HOST)
    if batched_copy:
        caps.add(Capability.BATCHED_COPY)
    return frozenset(getattr(c, "value", c) for c in caps)


def format_cuda_version(version: int | None) -> str:
    """``12080`` -> ``"12.8"``; ``None`` -> ``"unknown"``."""
    if version is None:
        return "unknown"
    return f"{version // 1000}.{version % 1000 // 10}"


def gpu_descriptor(
    name: str,
    vendor: str,
    facts: TorchFacts,
    *,
    pinned_host: bool,
    engines: list[str],
    batched: bool,
    details: Mapping[str, str],
    extra: frozenset[str] = frozenset(),
) -> DeviceDescriptor:
    """A present torch.cuda device (NVIDIA or AMD: both use torch device type ``"cuda"``).

    :param pinned_host: host buffers will be registered (``KVHAL_PIN_HOST`` is not ``off``).
    :param engines: copy engines offered, best first.
    :param batched: the first engine sends a batch in one call.
    :param details: vendor facts for ``kvhal devices``.
    :param extra: capabilities this vendor's plugin adds (verified on its hardware).
    """
    return DeviceDescriptor(
        name=name,
        torch_device_type="cuda",
        vendor=vendor,
        capabilities=gpu_capabilities(pinned_host, batched, extra),
        priority=100,
        device_count=facts.device_count,
        details={"torch": facts.torch_version, **details, **engine_details(engines)},
    )


def decide_cuda(
    facts: TorchFacts, *, pinned_host: bool, engines: list[str], batched: bool
) -> DeviceDescriptor | Refusal:
    """The CUDA probe's answer (arguments as for :func:`gpu_descriptor`)."""
    if facts.hip_version:
        return Refusal(
            f"torch {facts.torch_version} is a ROCm/HIP build (torch.version.hip={facts.hip_version}); "
            "kvhal-rocm serves it"
        )
    if not facts.cuda_version:
        return Refusal(
            f"torch {facts.torch_version} was built without CUDA (torch.version.cuda is None); "
            "install a CUDA build of torch"
        )
    if facts.device_count < 1:
        return Refusal(
            f"no CUDA device visible (torch.cuda.device_count() is 0 with torch {facts.torch_version}, "
            f"CUDA {facts.cuda_version}; check the driver and CUDA_VISIBLE_DEVICES)"
        )
    return gpu_descriptor(
        "cuda",
        "nvidia",
        facts,
        pinned_host=pinned_host,
        engines=engines,
        batched=batched,
        details={
            "torch.version.cuda": facts.cuda_version,
            "driver": format_cuda_version(facts.driver_version),
        },
        extra=frozenset({UINT8}),
    )
