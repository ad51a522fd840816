"""What a device plugin's probe returns: a descriptor of the device, or a refusal."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from kvhal.errors import ValidationError, check_int


class Capability(str, enum.Enum):
    """Optional abilities a plugin declares; the conformance suite tests each one
    declared and skips, naming it, each one not declared."""

    #: Allocates and copies cross-layer (``B``-outermost) caches.
    CROSS_LAYER = "layout.cross_layer"
    #: Allocates and copies caches kept as a (K, V) pair per layer.
    SPLIT_KV = "kv.split"
    #: Host buffers are page-locked (pinned or registered with the device).
    PINNED_HOST = "host.pinned"
    #: Copies run asynchronously to the calling thread.
    ASYNC_COPY = "copy.async"
    #: A batch of descriptors goes to the device in one call.
    BATCHED_COPY = "copy.batched"
    #: float8_e4m3fn caches.
    FP8 = "dtype.float8_e4m3fn"


def dtype_capability(dtype: torch.dtype) -> str:
    """The capability string that declares support for ``dtype``."""
    return "dtype." + str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class DeviceDescriptor:
    """A device a plugin found and can serve.

    :param name: the device's kvhal name (``"cpu"``, ``"cuda"``, ``"rocm"``, ``"npu"``).
    :param torch_device_type: the torch device type its tensors use
        (ROCm reports ``"cuda"``).
    :param vendor: who makes the device.
    :param capabilities: :class:`Capability` values (and ``dtype.*`` strings) it supports.
    :param priority: selection rank among present devices; accelerators
        should use 100, the CPU plugin uses 0.
    :param device_count: devices of this kind visible.
    :param details: free-form facts for ``kvhal devices`` (versions, copy engine).
    """

    name: str
    torch_device_type: str
    vendor: str
    capabilities: frozenset[str] = frozenset()
    priority: int = 100
    device_count: int = 1
    details: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for attr in ("name", "torch_device_type", "vendor"):
            value = getattr(self, attr)
            if not isinstance(value, str) or not value:
                raise ValidationError(attr, f"must be a non-empty str, got {value!r}")
        caps = frozenset(str(c.value if isinstance(c, Capability) else c) for c in self.capabilities)
        object.__setattr__(self, "capabilities", caps)
        check_int("priority", self.priority, minimum=None)
        check_int("device_count", self.device_count, message="must be an int >= 1, got {value!r}")
        object.__setattr__(self, "details", {str(k): str(v) for k, v in dict(self.details).items()})

    def supports(self, capability: Capability | str) -> bool:
        value = capability.value if isinstance(capability, Capability) else capability
        return value in self.capabilities


@dataclass(frozen=True)
class Refusal:
    """A plugin's answer when its hardware or software is not here.

    :param reason: one line a user can act on ("no CUDA device visible",
        "torch_npu is not installed").
    """

    reason: str

    def __post_init__(self) -> None:
        if not isinstance(self.reason, str) or not self.reason.strip():
            raise ValidationError("reason", "a refusal must say why")
