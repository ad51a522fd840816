"""Shared stores for the remote tier, offered by URL scheme through ``kvhal_remote_stores``.

The built-in ``mooncake`` (:mod:`kvhal.stores.mooncake`) and ``redis``
(:mod:`kvhal.stores.redis`, with ``rediss``, ``redis+cluster`` and
``rediss+cluster``) are offered by :class:`BuiltinStores`, which
:class:`~kvhal.registry.PluginRegistry` registers; any plugin can add more.
:func:`open_store` connects to the store a URL names.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from kvhal.errors import ValidationError
from kvhal.hookspecs import hookimpl
from kvhal.remote_store import RemoteStore, StoreFactory

if TYPE_CHECKING:
    from kvhal.registry import PluginRegistry

__all__ = ["HOOK", "BuiltinStores", "available_stores", "open_store", "url_scheme"]

HOOK = "kvhal_remote_stores"


def _open_mooncake(url: str) -> RemoteStore:
    from kvhal.stores.mooncake import MooncakeStore  # imported when used: it loads Mooncake's library

    return MooncakeStore.from_url(url)


def _open_redis(url: str) -> RemoteStore:
    from kvhal.stores.redis import RedisStore

    return RedisStore.from_url(url)


class BuiltinStores:
    """The built-in plugin offering Mooncake Store and Redis through the remote-store hook."""

    @hookimpl
    def kvhal_remote_stores(self) -> Mapping[str, StoreFactory]:
        redis = dict.fromkeys(("redis", "rediss", "redis+cluster", "rediss+cluster"), _open_redis)
        return {"mooncake": _open_mooncake, **redis}


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
    return {name: offer.factory for name, offer in registry.named_factories(HOOK, "remote store").items()}


def open_store(url: str, registry: PluginRegistry, argument: str = "remote_url") -> RemoteStore:
    """Connect to the store ``url`` names, through the plugin offering its scheme.

    :raises ValidationError: no plugin offers the scheme (the message lists
        those known), or the URL is malformed (naming the part at fault).
    :raises StoreUnavailable: the store cannot be reached.
    :raises MalformedResultError: the factory returned something else than a
        :class:`~kvhal.remote_store.RemoteStore` (names the plugin).
    :raises PluginError: the hook or the factory raised (names the plugin).
    """
    scheme = url_scheme(url, argument)
    return registry.create_named(
        HOOK,
        scheme,
        (url,),
        expected=RemoteStore,
        what="remote store",
        argument=argument,
        label="remote store URL scheme",
    )
