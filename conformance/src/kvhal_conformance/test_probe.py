"""Contract: probing (``kvhal_probe``) and the set of required hooks."""

from __future__ import annotations

import pytest
import torch

from kvhal.descriptor import Capability, DeviceDescriptor
from kvhal.hookspecs import DEVICE_HOOKS
from kvhal_conformance.target import Target

KNOWN_CAPABILITIES = {c.value for c in Capability}


def _descriptor(target: Target) -> DeviceDescriptor:
    outcome = target.registry.probe(target.info)
    if outcome.error is not None:
        pytest.fail(str(outcome.error))
    if outcome.descriptor is None:
        pytest.fail(
            f"{target.label}: kvhal_probe declined ({outcome.reason}); the suite needs the device present"
        )
    return outcome.descriptor


def test_required_hooks_implemented(kvhal_target: Target) -> None:
    """Every hook in kvhal.hookspecs.DEVICE_HOOKS is implemented (a missing one fails, named)."""
    if kvhal_target.info.error is not None:
        pytest.fail(f"{kvhal_target.label} failed to load: {kvhal_target.info.error}")
    implemented = kvhal_target.registry.implemented_hooks(kvhal_target.info)
    missing = [hook for hook in DEVICE_HOOKS if hook not in implemented]
    assert not missing, (
        f"{kvhal_target.label} does not implement required hook {', '.join(missing)}: "
        "every device plugin must implement all of kvhal.hookspecs.DEVICE_HOOKS"
    )


def test_probe_returns_descriptor(kvhal_target: Target) -> None:
    """kvhal_probe returns a DeviceDescriptor (the device must be present to be tested)."""
    _descriptor(kvhal_target)


def test_descriptor_is_well_formed(kvhal_target: Target) -> None:
    """The descriptor's torch device type exists and every capability is one kvhal knows."""
    d = _descriptor(kvhal_target)
    try:
        torch.device(d.torch_device_type)
    except RuntimeError as exc:
        pytest.fail(
            f"kvhal_probe: torch_device_type {d.torch_device_type!r} is not a torch device type: {exc}"
        )
    unknown = []
    for capability in sorted(d.capabilities):
        if capability.startswith("dtype."):
            if not isinstance(getattr(torch, capability.removeprefix("dtype."), None), torch.dtype):
                unknown.append(capability)
        elif capability not in KNOWN_CAPABILITIES:
            unknown.append(capability)
    assert not unknown, (
        f"kvhal_probe of {kvhal_target.label} declares unknown capabilities {unknown} (a typo?); "
        f"known: {sorted(KNOWN_CAPABILITIES)} and dtype.<torch dtype>"
    )
