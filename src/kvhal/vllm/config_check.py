"""The whole ``--kv-transfer-config`` checked, without vLLM's engine or a model.

``kvhal config check`` and the connector run the same checks, so a configuration the
command passes is one the engine starts with, and one it refuses is refused by the engine
before it loads the model where vLLM lets it (:func:`refuse_early`):

- :func:`check_transfer_config`: the top-level keys (``kv_connector`` is ``KVHALConnector``
  in ``kvhal.vllm``, ``kv_role``, ``kv_load_failure_policy`` is ``"recompute"``) and
  ``kv_connector_extra_config`` through its one declaration (:mod:`kvhal.vllm.settings`);
- :func:`check_machine`: what needs the machine: host memory for ``cpu_bytes_to_use``, each
  disk tier's directory (creatable, writable, not on a read-only file system), each tier
  backend and store URL scheme offered by a plugin (:mod:`kvhal.tiers.media`).

Nothing here writes a file or imports vLLM: writability is read with ``os.access`` and
``statvfs``, never by creating anything.
"""

from __future__ import annotations

import difflib
import json
import os
import stat
import sys
from collections.abc import Mapping
from typing import Any

from kvhal.errors import ValidationError
from kvhal.registry import PluginRegistry
from kvhal.tiers.media import available_stores, available_tiers, url_scheme
from kvhal.vllm.extra_config import (
    PREFIX,
    ExtraSettings,
    LowerTierConfig,
    RemoteTierConfig,
    check_extra_config,
)

__all__ = [
    "CONNECTOR",
    "MODULE_PATH",
    "TRANSFER_KEYS",
    "check_kv_transfer",
    "check_machine",
    "check_transfer_config",
    "machine_memory",
    "parse_transfer_config",
    "refuse_early",
    "refuse_from_caller",
]

CONNECTOR = "KVHALConnector"
MODULE_PATH = "kvhal.vllm"
#: Every key of vLLM's KVTransferConfig, 0.27.1's and 0.32's (a test holds the installed one's
#: fields to it): kvhal reads five and leaves the others to vLLM.
TRANSFER_KEYS = frozenset(
    {
        "kv_connector",
        "kv_connector_module_path",
        "kv_role",
        "kv_load_failure_policy",
        "kv_connector_extra_config",
        "engine_id",
        "kv_buffer_device",
        "kv_buffer_size",
        "kv_rank",
        "kv_parallel_size",
        "kv_ip",
        "kv_port",
        "enable_permute_local_kv",
    }
)
_WRITE_RECOMPUTE = '"kv_load_failure_policy": "recompute"'


def parse_transfer_config(text: str, source: str = "kv-transfer-config") -> dict[str, Any]:
    """``text`` as a kv-transfer-config JSON object.

    :raises ValidationError: (``source``) not JSON, or not an object; the position is named.
    """
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValidationError(
            source, f"is not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from None
    if not isinstance(value, dict):
        raise ValidationError(source, f"must be a JSON object, got {type(value).__name__}")
    return value


def check_transfer_config(config: Mapping[str, Any]) -> ExtraSettings:
    """The kv-transfer-config's keys checked, ``kv_connector_extra_config`` by its declaration.

    :raises ValidationError: naming the key, its value and what it takes.
    """
    unknown = sorted(set(config) - TRANSFER_KEYS)
    if unknown:
        close = [m for n in unknown for m in difflib.get_close_matches(n, TRANSFER_KEYS, n=1)]
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise ValidationError(
            unknown[0],
            f"unknown keys {unknown}{hint}; vLLM's kv-transfer-config takes {sorted(TRANSFER_KEYS)}",
        )
    _expect(config, "kv_connector", CONNECTOR, "kvhal's connector")
    if config.get("kv_connector_module_path") != "kvhal.vllm.connector":  # the class's own module works too
        _expect(config, "kv_connector_module_path", MODULE_PATH, "the module vLLM loads KVHALConnector from")
    _expect(
        config,
        "kv_role",
        "kv_both",
        "kvhal's host tier both stores blocks and loads them (kv_producer and kv_consumer are "
        "for disaggregated prefill)",
    )
    policy = config.get("kv_load_failure_policy")
    if policy != "recompute":
        got = 'absent (vLLM\'s default is "fail")' if policy is None else f"got {policy!r:.80}"
        raise ValidationError(
            "kv_load_failure_policy",
            f'must be "recompute", {got}: kvhal is a cache, and a block it cannot load (a store '
            'that went down, a damaged block) is recomputed; with "fail" vLLM aborts the request '
            f"instead. Write {_WRITE_RECOMPUTE}",
        )
    return check_extra_config(config.get("kv_connector_extra_config"))


def _expect(config: Mapping[str, Any], key: str, wanted: str, what: str) -> None:
    value = config.get(key)
    if value != wanted:
        got = "absent" if key not in config else f"got {value!r:.80}"
        raise ValidationError(key, f"must be {wanted!r} ({what}), {got}")


def machine_memory() -> int:
    """This machine's physical memory in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_machine(
    settings: ExtraSettings, registry: PluginRegistry | None = None, *, listed: bool = False
) -> None:
    """What needs the machine: host memory, each disk tier's directory, each backend and store
    scheme offered by a plugin. Writes nothing.

    :param listed: the tiers were given as ``tiers`` (not by short forms): names their keys.

    :raises ValidationError: naming the user's key.
    """
    memory = machine_memory()
    if settings.cpu_bytes_to_use > memory:
        raise ValidationError(
            f"{PREFIX}.cpu_bytes_to_use",
            f"{settings.cpu_bytes_to_use} bytes is more than this machine's memory ({memory} bytes): "
            "the host tier is pinned host memory, per engine; give at most what the engine may take",
        )
    if not settings.tiers:
        return
    registry = registry or PluginRegistry()
    for i, tier in enumerate(settings.tiers):
        if isinstance(tier, RemoteTierConfig):
            _check_scheme(tier, registry)
            continue
        where = f"{PREFIX}.tiers[{i}]." if listed else f"{PREFIX}.tier_"
        _check_backend(tier, registry, where + "backend")
        if tier.backend == "disk":
            path_key = tier.config_keys.get("path", f"{where}options.path")
            _check_directory(str(tier.options["path"]), path_key)


def _check_scheme(tier: RemoteTierConfig, registry: PluginRegistry) -> None:
    key = tier.key("url")
    scheme = url_scheme(tier.url, key)
    offered = available_stores(registry)
    if scheme not in offered:
        raise ValidationError(
            key,
            f"no store plugin takes the URL scheme {scheme!r}; the installed plugins take {sorted(offered)}",
        )


def _check_backend(tier: LowerTierConfig, registry: PluginRegistry, key: str) -> None:
    offered = available_tiers(registry)
    if tier.backend not in offered:
        raise ValidationError(
            key,
            f"no plugin offers the tier backend {tier.backend!r}; the installed ones are {sorted(offered)}",
        )


def _check_directory(path: str, key: str) -> None:
    """``path`` is, or can be made, a directory the engine writes: the refusals of the disk tier's
    opening (kvhal.tiers.disk.directory.open_root), read without creating anything."""
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):  # to be created (or not: see below)
        st = None
    except OSError as exc:
        raise ValidationError(key, f"{path}: cannot be read ({exc.strerror})") from None
    if st is not None:
        if stat.S_ISLNK(st.st_mode):
            raise ValidationError(key, f"{path} is a symbolic link; give the real directory")
        if not stat.S_ISDIR(st.st_mode):
            raise ValidationError(key, f"{path} exists and is not a directory")
        if st.st_mode & stat.S_IWOTH:
            raise ValidationError(
                key,
                f"{path} is world-writable (mode {stat.S_IMODE(st.st_mode):o}): "
                "use a directory others cannot write",
            )
    # the directory itself, or the nearest existing parent it would be created in
    where = os.path.abspath(path)
    while not os.path.lexists(where):
        where = os.path.dirname(where)
    if not os.path.isdir(where):
        raise ValidationError(key, f"{path} cannot be created: {where} is not a directory")
    if os.statvfs(where).f_flag & os.ST_RDONLY:
        raise ValidationError(key, f"{path} is on a read-only file system ({where}); give a writable one")
    if not os.access(where, os.W_OK | os.X_OK):
        verb = "written" if where == os.path.abspath(path) else f"created (this user cannot write {where})"
        raise ValidationError(key, f"{path} cannot be {verb}")


def check_kv_transfer(config: Mapping[str, Any], registry: PluginRegistry | None = None) -> ExtraSettings:
    """Every check, what ``kvhal config check`` runs: :func:`check_transfer_config`, then
    :func:`check_machine`."""
    settings = check_transfer_config(config)
    extra = config.get("kv_connector_extra_config")
    check_machine(settings, registry, listed=isinstance(extra, Mapping) and "tiers" in extra)
    return settings


#: The configurations :func:`refuse_early` passed, so a process checks each once.
_PASSED: set[str] = set()


def refuse_early(kv_transfer_config: Any) -> None:
    """The checks of ``kvhal config check`` on vLLM's KVTransferConfig object (the keys kvhal
    reads; the others are vLLM's to check), once a process for each configuration.

    :raises ValidationError: naming the key.
    """
    config = {key: getattr(kv_transfer_config, key, None) for key in _READ}
    seen = json.dumps(config, sort_keys=True, default=repr)
    if seen not in _PASSED:
        check_kv_transfer({k: v for k, v in config.items() if v is not None})
        _PASSED.add(seen)


#: The keys kvhal reads from vLLM's KVTransferConfig.
_READ = (
    "kv_connector",
    "kv_connector_module_path",
    "kv_role",
    "kv_load_failure_policy",
    "kv_connector_extra_config",
)


def refuse_from_caller() -> None:
    """Run :func:`refuse_early` on the KVTransferConfig of vLLM's connector factory, when it is
    the caller's caller: vLLM looks the connector class up (``getattr(kvhal.vllm,
    "KVHALConnector")``) in ``VllmConfig.__post_init__``, in the process that builds the
    configuration, before any engine process starts or the model loads (0.27.1 and 0.32); no
    hook of the class is called with the configuration that early on every device."""
    try:
        frame = sys._getframe(2)  # refuse_from_caller <- kvhal.vllm.__getattr__ <- the factory
    except ValueError:  # no such caller
        return
    config = frame.f_locals.get("kv_transfer_config")
    if type(config).__name__ == "KVTransferConfig":
        refuse_early(config)
