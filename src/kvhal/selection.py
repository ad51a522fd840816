"""Picking a device plugin from what the probes said, and saying why each other one lost.

Strictest first:

1. a device named by argument, else by ``KVHAL_DEVICE``: that plugin or an error;
2. a torch device type (the engine's): the present plugins serving it;
3. otherwise every present plugin.

The highest ``priority`` wins; a tie is an error. A plugin that failed to load or to
probe is an error naming it: kvhal never silently falls back to another device.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvhal.descriptor import DeviceDescriptor
from kvhal.device import Device
from kvhal.discovery import ENV_BLOCK, ENV_DEVICE, PluginInfo
from kvhal.errors import DeviceSelectionError, KVHALError, PluginError


@dataclass
class ProbeOutcome:
    """What one device plugin's probe said."""

    info: PluginInfo
    descriptor: DeviceDescriptor | None = None
    reason: str | None = None
    error: PluginError | None = None

    @property
    def present(self) -> bool:
        return self.descriptor is not None


@dataclass
class Selection:
    """The outcome of device selection, with every probe, for ``kvhal devices``."""

    outcomes: list[ProbeOutcome]
    device: Device | None = None
    error: KVHALError | None = None
    why: str = ""
    others: dict[str, str] = field(default_factory=dict)


def why_not(outcome: ProbeOutcome, selection: Selection, device_type: str | None) -> str:
    """Why ``outcome``'s plugin was not the one selected, in a few words."""
    if not outcome.present:
        return outcome.reason or "not present"
    d = outcome.descriptor
    assert d is not None
    if device_type and d.torch_device_type != device_type:
        return f"serves torch device type {d.torch_device_type!r}, not {device_type!r}"
    if selection.device is not None:
        return (
            f"present, but priority {d.priority} < {selection.device.descriptor.priority} "
            f"of {selection.device.plugin_name!r}"
            if d.priority < selection.device.descriptor.priority
            else "present, but another device was named"
        )
    return "present"


def choose(
    outcomes: list[ProbeOutcome],
    plugins: list[PluginInfo],
    name: str | None,
    device_type: str | None,
    named_by: str,
) -> tuple[ProbeOutcome, str]:
    """The outcome selected (see the module docstring) and why, else the error to raise.

    :param plugins: every plugin found, loaded or not, for the message when ``name`` is none.
    :param named_by: what named ``name`` (``"argument"``, ``KVHAL_DEVICE``), for ``why``.
    """
    broken = [o for o in outcomes if o.error is not None]
    if name is not None:
        matches = [o for o in outcomes if o.info.name == name]
        if not matches:
            known = ", ".join(sorted(p.name for p in plugins)) or "none"
            blocked = [p for p in plugins if p.name == name and p.blocked_by]
            hint = f" ({blocked[0].blocked_by})" if blocked else ""
            raise DeviceSelectionError(
                f"device plugin {name!r} was asked for but is not available{hint}; plugins found: {known}"
            )
        outcome = matches[0]
        if outcome.error is not None:
            raise outcome.error
        if not outcome.present:
            raise DeviceSelectionError(f"device plugin {name!r} was asked for but declined: {outcome.reason}")
        return outcome, f"named by {named_by}"
    if broken:
        raise broken[0].error  # type: ignore[misc]
    present = [o for o in outcomes if o.present]
    if device_type is not None:
        present = [o for o in present if o.descriptor.torch_device_type == device_type]  # type: ignore[union-attr]
    if not present:
        listing = "; ".join(f"{o.info.name}: {o.reason or 'present'}" for o in outcomes) or "no plugins"
        wanted = f" for torch device type {device_type!r}" if device_type else ""
        raise DeviceSelectionError(f"no kvhal device plugin can serve{wanted}. Plugins found: {listing}")
    top = max(o.descriptor.priority for o in present)  # type: ignore[union-attr]
    best = [o for o in present if o.descriptor.priority == top]  # type: ignore[union-attr]
    if len(best) > 1:
        names = ", ".join(o.info.name for o in best)
        raise DeviceSelectionError(
            f"several device plugins are present with priority {top}: {names}; "
            f"choose one with {ENV_DEVICE}=NAME or block the others with {ENV_BLOCK}"
        )
    why = f"highest priority ({top}) among present plugins"
    if device_type is not None:
        why += f" serving torch device type {device_type!r}"
    return best[0], why
