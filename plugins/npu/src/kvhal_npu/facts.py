"""What torch_npu, AscendCL and vllm-ascend say about this machine, and the probe's decision.

:func:`decide_npu` is pure over :class:`NpuFacts`; :func:`gather_npu_facts`
imports torch_npu only if it is installed (the import registers ``torch.npu``:
``rename_privateuse1_backend("npu")``, ``_register_device_module``).

vllm-ascend registers its compiled ops (``torch.ops._C_ascend.*``) lazily, in
``vllm_ascend.utils.enable_custom_op()``, so that CANN's runtime is not
initialised before the worker picks its device. :func:`find_ascend_op` calls
it before looking for ``swap_blocks_batch``; the plugin looks again at the
first copy, so an op loaded after the probe is still used.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
from dataclasses import dataclass

import torch

from kvhal.accel.engines import engine_details, op_registered
from kvhal.descriptor import Capability, DeviceDescriptor, Refusal
from kvhal_npu.host_memory import choose_pin_routes, load_acl

log = logging.getLogger(__name__)

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
    :param ascend_op_absent: why it is not, when it is not.
    :param pin_routes: the AscendCL calls that can page-lock host buffers, in the order
        tried (:func:`kvhal_npu.host_memory.choose_pin_routes`); empty: none can.
    :param pin_note: those routes and what was left out, in words.
    """

    torch_version: str
    torch_npu_installed: bool = False
    torch_npu_version: str | None = None
    import_error: str | None = None
    device_count: int = 0
    ascend_op: bool = False
    ascend_op_absent: str | None = None
    pin_routes: tuple[str, ...] = ()
    pin_note: str = ""


def ascend_op_registered() -> bool:
    """Whether ``torch.ops._C_ascend.swap_blocks_batch`` resolves now (looked up afresh each call)."""
    return op_registered(ASCEND_OP_NAMESPACE, ASCEND_OP_NAME)


def load_ascend_ops() -> str | None:
    """Have vllm-ascend register its compiled ops: ``vllm_ascend.utils.enable_custom_op()``.

    :return: why they could not be loaded, or ``None``.
    """
    if "vllm_ascend" not in sys.modules:
        try:
            installed = importlib.util.find_spec("vllm_ascend") is not None
        except (ImportError, ValueError):
            installed = False
        if not installed:
            return "vllm-ascend is not installed"
    try:
        enabled = importlib.import_module("vllm_ascend.utils").enable_custom_op()
    except Exception as exc:  # an incompatible vllm-ascend must not break the probe
        return f"vllm_ascend.utils.enable_custom_op() raised {type(exc).__name__}: {exc}"
    if not enabled:
        return "vllm_ascend.utils.enable_custom_op() returned False (its ops are disabled or failed to load)"
    return None


def find_ascend_op() -> tuple[bool, str | None]:
    """Whether vllm-ascend's ``swap_blocks_batch`` is usable, loading vllm-ascend's ops first
    if it is not registered yet; and why not, when not."""
    if ascend_op_registered():
        return True, None
    why = load_ascend_ops()
    if ascend_op_registered():
        return True, None
    return False, why or f"torch.ops.{ASCEND_OP_NAMESPACE}.{ASCEND_OP_NAME} is not registered"


def gather_npu_facts() -> NpuFacts:
    facts = NpuFacts(torch_version=torch.__version__)
    if importlib.util.find_spec("torch_npu") is None:
        return facts
    try:
        torch_npu = importlib.import_module("torch_npu")
        count = int(torch.npu.device_count())  # type: ignore[attr-defined]
    except Exception as exc:  # a broken CANN install must not break kvhal
        return NpuFacts(facts.torch_version, True, import_error=f"{type(exc).__name__}: {exc}")
    ascend_op, absent = find_ascend_op() if count > 0 else (False, "no NPU visible")
    pin_routes, pin_note = choose_pin_routes(load_acl(), os.uname().release)
    return NpuFacts(
        facts.torch_version,
        True,
        torch_npu_version=str(getattr(torch_npu, "__version__", "unknown")),
        device_count=count,
        ascend_op=ascend_op,
        ascend_op_absent=absent,
        pin_routes=pin_routes,
        pin_note=pin_note,
    )


def decide_npu(
    facts: NpuFacts, engines: list[str], batched: bool, pinned_host: bool = True
) -> DeviceDescriptor | Refusal:
    """The NPU probe's answer.

    :param pinned_host: host buffers are to be pinned (``KVHAL_PIN_HOST`` is not ``off``);
        ``host.pinned`` is declared only if some :attr:`NpuFacts.pin_routes` can pin them.
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
    caps = {Capability.SPLIT_KV, Capability.ASYNC_COPY, Capability.OVERLAPPED_COPY}
    if pinned_host and facts.pin_routes:
        caps.add(Capability.PINNED_HOST)
    if not pinned_host:
        pinning = "off (KVHAL_PIN_HOST=off)"
    else:
        pinning = facts.pin_note if facts.pin_routes else f"pageable: {facts.pin_note}"
    ascend_op = {} if facts.ascend_op else {"ascend_op": f"not used: {facts.ascend_op_absent or 'absent'}"}
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
            "host_pinning": pinning,
            **engine_details(engines),
            **ascend_op,
        },
    )
