"""The engine's start, in its log: which kvhal runs, on which device plugin, with which C
extensions, and which tiers of what size.

One line, logged once by the scheduler-side connector, and a warning for each C extension
that was not built (:mod:`kvhal.build_info`: what it costs and the fix). Formatting imports
no vLLM, so it is tested without an engine.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from kvhal import build_info
from kvhal.registry import PluginRegistry
from kvhal.tiers.remote.urls import redact
from kvhal.vllm.extra_config import RemoteTierConfig

if TYPE_CHECKING:
    from kvhal.vllm.config import ConnectorConfig

__all__ = ["device_plugin", "log_start", "size", "start_line", "tiers_text"]


def size(nbytes: int) -> str:
    """``nbytes`` for people: ``8.0 GiB``, ``512.0 KiB``, ``100 B``."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{nbytes} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def tiers_text(config: ConnectorConfig) -> str:
    """The tiers from top to bottom, each by its name (as the ``tier`` label of the metrics)
    with its size (a store's is the store's own)."""
    host = (
        f"host {size(config.cpu_bytes_to_use)} per engine ({config.world_size} worker"
        f"{'s' if config.world_size != 1 else ''}, {config.num_slots} slots of "
        f"{size(config.slot_bytes)} each, {config.eviction_policy})"
    )
    parts = [host]
    for tier in config.tiers:  # every tier below the host tier, in order
        if isinstance(tier, RemoteTierConfig):  # a store the fleet shares
            parts.append(
                f"{tier.name} {redact(tier.url)} (lookup {tier.lookup_timeout_ms} ms, "
                f"load {tier.load_timeout_ms} ms, auth {tier.auth})"
            )
            continue
        where = tier.options.get("path")
        budget = tier.options.get("bytes_to_use")
        sized = size(budget) if isinstance(budget, int) else "size of the backend's choosing"
        parts.append(
            f"{tier.name} {sized}{f' at {where}' if where else ''} "
            f"(write-{tier.write}, {tier.eviction_policy})"
        )
    return " > ".join(parts)


def device_plugin(config: ConnectorConfig, device_type: str | None) -> str:
    """The device plugin the workers will select (they select it again, and their selection is
    the one that counts: a failure here is reported, never raised)."""
    try:
        selection = PluginRegistry().explain(config.device, device_type=device_type)
    except Exception as exc:  # the log line must not be what stops an engine
        return f"not known ({type(exc).__name__}: {exc})"
    if selection.device is None:
        return f"none ({selection.error})"
    device = selection.device
    return f"{device.plugin_name!r} ({device.distribution or 'distribution unknown'})"


def start_line(
    config: ConnectorConfig,
    device: str,
    versions: dict[str, str],
    extensions: dict[str, str | None],
) -> str:
    """The one line: kvhal's version and its plugins', the device plugin, the C extensions
    (which are missing), the tiers with their sizes."""
    kvhal = versions.get("kvhal", "unknown")
    others = ", ".join(f"{name} {version}" for name, version in versions.items() if name != "kvhal")
    missing = [module for module, reason in extensions.items() if reason is not None]
    built = len(extensions) - len(missing)
    native = f"C extensions {built} of {len(extensions)} built"
    if missing:
        native += f" (missing: {', '.join(missing)}; slower paths run, see the warnings)"
    return (
        f"kvhal {kvhal}{f' ({others})' if others else ''}: device plugin {device}; {native}; "
        f"tiers: {tiers_text(config)}"
    )


def log_start(logger: logging.Logger, config: ConnectorConfig, vllm_config: Any) -> None:
    """Log the start line once, and a warning per C extension that was not built."""
    device_config = getattr(vllm_config, "device_config", None)
    device_type = getattr(device_config, "device_type", None)
    extensions = build_info.extension_status()
    device = device_plugin(config, device_type)
    logger.info("%s", start_line(config, device, build_info.distribution_versions(), extensions))
    by_module = {ext.module: ext for ext in build_info.EXTENSIONS}
    for module, reason in extensions.items():
        if reason is not None:
            logger.warning("%s", build_info.missing_extension_warning(by_module[module], reason))
