"""Tiers below the host tier: backends offered by name through ``kvhal_tier_backends``.

The built-in ``disk`` backend (:mod:`kvhal.tiers.disk`) is offered by
:class:`BuiltinTiers`, which :class:`~kvhal.registry.PluginRegistry`
registers; any plugin can add more. :func:`open_tier` opens one by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from kvhal.hookspecs import hookimpl
from kvhal.tier_backend import TierBackend, TierFactory, TierSpec

if TYPE_CHECKING:
    from kvhal.registry import PluginRegistry

__all__ = ["DEFAULT_TIER", "HOOK", "BuiltinTiers", "available_tiers", "open_tier"]

HOOK = "kvhal_tier_backends"
DEFAULT_TIER = "disk"


def _open_disk(spec: TierSpec) -> TierBackend:
    from kvhal.tiers.disk import DiskTier  # imported when used: its I/O machinery is not free

    return DiskTier(spec)


class BuiltinTiers:
    """The built-in plugin offering ``disk`` through the tier-backend hook."""

    @hookimpl
    def kvhal_tier_backends(self) -> Mapping[str, TierFactory]:
        return {"disk": _open_disk}


def available_tiers(registry: PluginRegistry) -> dict[str, TierFactory]:
    """Every tier backend the registry's plugins offer, by name.

    :raises MalformedResultError: a plugin answered with something other than
        a mapping of names to factories.
    :raises PluginError: two plugins offer the same name.
    """
    return {name: offer.factory for name, offer in registry.named_factories(HOOK, "tier backend").items()}


def open_tier(name: str, spec: TierSpec, registry: PluginRegistry) -> TierBackend:
    """Open the tier backend offered as ``name`` for ``spec``.

    :raises ValidationError: no plugin offers ``name`` (the message lists those
        known), or the backend refused an option (naming it).
    :raises MalformedResultError: its factory returned something else than a
        :class:`~kvhal.tier_backend.TierBackend` (names the plugin).
    :raises PluginError: the hook or the factory raised (names the plugin).
    """
    return registry.create_named(
        HOOK, name, (spec,), expected=TierBackend, what="tier backend", argument="tier", label="tier backend"
    )
