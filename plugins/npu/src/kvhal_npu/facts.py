"""What torch_npu and vllm-ascend say about this machine, and the probe's decision.

:func:`decide_npu` is pure over :class:`NpuFacts`; :func:`gather_npu_facts`
imports torch_npu only if it is installed (the import registers ``torch.npu``:
``rename_privateuse1_backend("npu")``, ``_register_device_module``).
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass

import torch

from kvhal.accel.engines import engine_details
from kvhal.descriptor import Capability, DeviceDescriptor, Refusal

#: ``torch.ops._C_ascend.swap_blocks_batch(src_ptrs, dst_ptrs, sizes, int direction)``
#: from vllm-ascend's ``csrc/torch_binding.cpp`` (CPU dispatch key, current NPU stream).
ASCEND_OP_NAMESPACE, ASCEND_OP_NAME = "_C_ascend", "swap_blocks_batch"


@dataclass(frozen=True)
class NpuFacts:
    """Facts the NPU plugin decides on.

    :param torch_version: ``torch.__version__``.
    :param torch_npu_installed: ``torch_npu`` can be found.
    :param torch_npu_version: its ``__version__`` once imported.
    :param import_error: why importing it failed, if it did.
    :param device_count: ``torch.npu.device_count()``.
    :param ascend_op: vllm-ascend's ``swap_blocks_batch`` op is registered.
    """

    torch_version: str
    torch_npu_installed: bool = False
    torch_npu_version: str | None = None
    import_error: str | None = None
    device_count: int = 0
    ascend_op: bool = False


def gather_npu_facts() -> NpuFacts:
    facts = NpuFacts(torch_version=torch.__version__)
    if importlib.util.find_spec("torch_npu") is None:
        return facts
    try:
        torch_npu = importlib.import_module("torch_npu")
        count = int(torch.npu.device_count())  # type: ignore[attr-defined]
    except Exception as exc:  # a broken CANN install must not break kvhal
        return NpuFacts(facts.torch_version, True, import_error=f"{type(exc).__name__}: {exc}")
    try:
        getattr(getattr(torch.ops, ASCEND_OP_NAMESPACE), ASCEND_OP_NAME)
        ascend_op = True
    except (AttributeError, RuntimeError):
        ascend_op = False
    return NpuFacts(
        facts.torch_version,
        True,
        torch_npu_version=str(getattr(torch_npu, "__version__", "unknown")),
        device_count=count,
        ascend_op=ascend_op,
    )


def decide_npu(
    facts: NpuFacts, engines: list[str], batched: bool, pinned_host: bool = True
) -> DeviceDescriptor | Refusal:
    """The NPU probe's answer.

    :param pinned_host: host buffers will be pinned (``KVHAL_PIN_HOST`` is not ``off``).
    """
    if not facts.torch_npu_installed:
        return Refusal(
            "torch_npu is not installed (install kvhal-npu with its npu extra on an Ascend machine)"
        )
    if facts.import_error:
        return Refusal(f"torch_npu is installed but failed to import: {facts.import_error}")
    if facts.device_count < 1:
        return Refusal(
            f"no Ascend NPU visible (torch.npu.device_count() is 0 with torch_npu {facts.torch_npu_version}; "
            "check the driver, CANN and ASCEND_RT_VISIBLE_DEVICES)"
        )
    caps = {Capability.SPLIT_KV, Capability.ASYNC_COPY}
    if pinned_host:
        caps.add(Capability.PINNED_HOST)
    if batched:
        caps.add(Capability.BATCHED_COPY)
    return DeviceDescriptor(
        name="npu",
        torch_device_type="npu",
        vendor="huawei",
        capabilities=frozenset(caps),
        priority=100,
        device_count=facts.device_count,
        details={
            "torch": facts.torch_version,
            "torch_npu": str(facts.torch_npu_version),
            "kv_alignment": "2 MiB per layer and part (vllm-ascend _align_memory)",
            **engine_details(engines),
        },
    )
