"""The media below the host tier, offered by name: where a tier or a store comes from.

Tier backends come through the ``kvhal_tier_backends`` hook, by name: the
built-in ``disk`` (:mod:`kvhal.tiers.disk`). Remote stores come through the
``kvhal_remote_stores`` hook, by URL scheme: the built-in ``mooncake``
(:mod:`kvhal.tiers.stores.mooncake`), ``redis``
(:mod:`kvhal.tiers.stores.redis`, with ``rediss``, ``redis+cluster`` and
``rediss+cluster``) and ``s3`` (:mod:`kvhal.tiers.stores.s3`, any server of the S3
API). :class:`BuiltinTiers` and :class:`BuiltinStores` offer the
built-in ones (the registry reads them from its table of built-in plugins); any
plugin can add more. :func:`open_tier` opens a backend by name,
:func:`open_store` connects to the store a URL names.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from kvhal.errors import ValidationError
from kvhal.hookspecs import hookimpl
from kvhal.tiers.backend import TierBackend, TierFactory, TierSpec
from kvhal.tiers.remote.store import RemoteStore, StoreFactory, StoreUnavailable

if TYPE_CHECKING:
    from kvhal.registry import PluginRegistry

__all__ = [
    "DEFAULT_TIER",
    "STORE_HOOK",
    "TIER_HOOK",
    "BuiltinStores",
    "BuiltinTiers",
    "available_stores",
    "available_tiers",
    "open_store",
    "open_tier",
    "url_scheme",
]

TIER_HOOK = "kvhal_tier_backends"
STORE_HOOK = "kvhal_remote_stores"
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
    return {
        name: offer.factory for name, offer in registry.named_factories(TIER_HOOK, "tier backend").items()
    }


def open_tier(name: str, spec: TierSpec, registry: PluginRegistry) -> TierBackend:
    """Open the tier backend offered as ``name`` for ``spec``.

    :raises ValidationError: no plugin offers ``name`` (the message lists those
        known), or the backend refused an option (naming it).
    :raises MalformedResultError: its factory returned something else than a
        :class:`~kvhal.tiers.backend.TierBackend` (names the plugin).
    :raises PluginError: the hook or the factory raised (names the plugin).
    """
    return registry.create_named(
        TIER_HOOK,
        name,
        (spec,),
        expected=TierBackend,
        what="tier backend",
        argument="tier",
        label="tier backend",
    )


def _open_mooncake(url: str) -> RemoteStore:
    from kvhal.tiers.stores.mooncake import MooncakeStore  # imported when used: it loads Mooncake's library

    return MooncakeStore.from_url(url)


def _open_redis(url: str) -> RemoteStore:
    from kvhal.tiers.stores.redis import RedisStore

    return RedisStore.from_url(url)


def _open_s3(url: str) -> RemoteStore:
    from kvhal.tiers.stores.s3 import S3Store  # imported when used: it loads obstore

    return S3Store.from_url(url)


class BuiltinStores:
    """The built-in plugin offering Mooncake Store, Redis and S3 through the remote-store hook."""

    @hookimpl
    def kvhal_remote_stores(self) -> Mapping[str, StoreFactory]:
        redis = dict.fromkeys(("redis", "rediss", "redis+cluster", "rediss+cluster"), _open_redis)
        return {"mooncake": _open_mooncake, **redis, "s3": _open_s3}


def url_scheme(url: str, argument: str = "remote_url") -> str:
    """The scheme of ``url`` (``mooncake``, ``redis``, ...), lower-cased.

    :raises ValidationError: ``url`` is not a string of the form ``scheme://...``.
    """
    if not isinstance(url, str) or "://" not in url:
        raise ValidationError(argument, f"must be a URL such as redis://HOST:PORT/0, got {url!r:.80}")
    return urlsplit(url).scheme.lower()


def available_stores(registry: PluginRegistry) -> dict[str, StoreFactory]:
    """Every store the registry's plugins offer, by URL scheme.

    :raises MalformedResultError: a plugin answered with something other than
        a mapping of schemes to factories.
    :raises PluginError: two plugins offer the same scheme.
    """
    return {
        name: offer.factory for name, offer in registry.named_factories(STORE_HOOK, "remote store").items()
    }


def open_store(url: str, registry: PluginRegistry, argument: str = "remote_url") -> RemoteStore:
    """Connect to the store ``url`` names, through the plugin offering its scheme.

    :raises ValidationError: no plugin offers the scheme (the message lists
        those known), or the URL is malformed (naming the part at fault).
    :raises StoreUnavailable: the store cannot be reached.
    :raises MalformedResultError: the factory returned something else than a
        :class:`~kvhal.tiers.remote.store.RemoteStore` (names the plugin).
    :raises PluginError: the hook or the factory raised (names the plugin).
    """
    scheme = url_scheme(url, argument)
    return registry.create_named(
        STORE_HOOK,
        scheme,
        (url,),
        expected=RemoteStore,
        what="remote store",
        argument=argument,
        label="remote store URL scheme",
        passes=(StoreUnavailable,),  # the store is down: the remote tier marks itself down, no plugin fault
    )
