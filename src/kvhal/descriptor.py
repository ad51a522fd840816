"""What a device plugin's probe returns: a descriptor of the device, or a refusal."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from kvhal.errors import ValidationError, check_int


class Capability(str, enum.Enum):
    """Optional abilities a plugin declares in :attr:`DeviceDescriptor.capabilities`.

    The conformance suite tests each one declared and skips, naming it, each one
    not declared; kvhal refuses (:class:`~kvhal.errors.ValidationError` naming the
    capability) to allocate or copy what needs an undeclared one. Besides these,
    ``dtype.<torch dtype>`` strings (:func:`dtype_capability`) declare dtypes
    beyond the required bfloat16, float16 and float32. Any other string fails the
    probe's contract, so a typo does not go unnoticed.
    """

    #: Allocates and copies cross-layer (``B``-outermost) caches.
    CROSS_LAYER = "layout.cross_layer"
    #: Allocates and copies caches kept as a (K, V) pair per layer.
    SPLIT_KV = "kv.split"
    #: Host buffers are page-locked (pinned or registered with the device).
    PINNED_HOST = "host.pinned"
    #: Copies run asynchronously to the calling thread.
    ASYNC_COPY = "copy.async"
    #: A batch of descriptors goes to the device in one call (reported; not testable from outside).
    BATCHED_COPY = "copy.batched"
    #: Copies run on hardware of their own (DMA engines) beside compute, not on the cores that
    #: compute: kvhal splits a large synchronous load layer by layer to hide it behind the
    #: forward (reported; not testable from outside). The CPU plugin's copies share the cores.
    OVERLAPPED_COPY = "copy.overlapped"
    #: float8_e4m3fn caches.
    FP8 = "dtype.float8_e4m3fn"
    #: A test capability: the plugin can make its own device engine fail on purpose
    #: (``kvhal_inject_device_fault``), so the conformance suite checks how it reports faults.
    FAULTS = "test.faults"


def dtype_capability(dtype: torch.dtype) -> str:
    """The capability string that declares support for ``dtype``
    (``dtype_capability(torch.float8_e5m2) == "dtype.float8_e5m2"``)."""
    return "dtype." + str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class DeviceDescriptor:
    """A device a plugin found and can serve: what ``kvhal_probe`` returns when it is here.

    Frozen, and checked when made (:class:`~kvhal.errors.ValidationError` naming
    the field).

    :param name: the device's name as users read it (``"cpu"``, ``"cuda"``,
        ``"rocm"``, ``"npu"``): ``kvhal devices``, :attr:`kvhal.device.Device.name`
        and kvhal's messages show it. It is not the plugin's name: that is the
        name of its entry point in ``kvhal.plugins``, which ``KVHAL_DEVICE``,
        :func:`kvhal.select_device`, the allow and block lists and ``kvhal
        conformance --device`` use. kvhal never selects by this name and does not
        require the two to match; use one string for both unless there is a reason.
    :param torch_device_type: the torch device type its tensors use
        (ROCm reports ``"cuda"``).
    :param vendor: who makes the device.
    :param capabilities: :class:`Capability` values (and ``dtype.*`` strings) it
        supports; stored as a frozenset of strings.
    :param priority: selection rank among present devices of the type asked for:
        the highest wins and a tie is an error (``several device plugins are
        present with priority N``) that breaks automatic selection for everyone
        who has both plugins. Any int, negative ones included. The CPU plugin uses
        0, kvhal's accelerator plugins 100 (the default); a plugin that is not the
        default one for its device type takes a priority below that plugin's, used
        by no other, and is chosen by name.
    :param device_count: devices of this kind visible (at least 1).
    :param details: free-form facts for ``kvhal devices`` and the conformance
        report (versions, copy engine); keys and values become strings.
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
        """Whether ``capability`` (a :class:`Capability` or its string) is declared."""
        value = capability.value if isinstance(capability, Capability) else capability
        return value in self.capabilities


@dataclass(frozen=True)
class Refusal:
    """A plugin's answer when its hardware or software is not here: ``kvhal_probe``
    returns it instead of raising. ``kvhal devices`` shows the reason; a refusing
    plugin is never selected automatically and breaks nothing for anyone.

    :param reason: one line a user can act on ("no CUDA device visible",
        "torch_npu is not installed"); it must not be empty.
    """

    reason: str

    def __post_init__(self) -> None:
        if not isinstance(self.reason, str) or not self.reason.strip():
            raise ValidationError("reason", "a refusal must say why")
