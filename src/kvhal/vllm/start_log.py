"""The engine's start, in its log: which kvhal runs, on which device plugin, with which C
extensions, and which tiers of what size.

One line, logged once by the scheduler-side connector, and a warning for each C extension
that was not built (:mod:`kvhal.build_info`: what it costs and the fix), and one when the
device plugin cannot pin (page-lock) host memory here (:func:`pinning_warning`: a container
without ``CAP_IPC_LOCK`` or an unlimited ``RLIMIT_MEMLOCK``). Formatting imports no vLLM, so
it is tested without an engine.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvhal import build_info, env
from kvhal.descriptor import Capability, DeviceDescriptor
from kvhal.registry import PluginRegistry
from kvhal.tiers.remote.urls import redact
from kvhal.vllm.extra_config import RemoteTierConfig

if TYPE_CHECKING:
    from kvhal.vllm.config import ConnectorConfig

__all__ = [
    "HostMemory",
    "cpu_binding_warning",
    "device_plugin",
    "host_memory",
    "log_start",
    "pinning_warning",
    "size",
    "start_line",
    "tiers_text",
]

#: The settings that turn pinning off on purpose (then pageable memory is no surprise: no warning).
PINNING_OFF = {"KVHAL_PIN_HOST": "off", "KVHAL_CPU_MLOCK": "0"}


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


@dataclass(frozen=True)
class HostMemory:
    """Whether the selected device plugin pins (page-locks) host memory in this process.

    The scheduler decides as its workers will: they are its children, with its limits and
    capabilities, and select the same plugin.
    """

    #: None: no plugin was selected (the workers' selection will say why)
    pinned: bool | None
    #: the plugin's own words on its host memory (``kvhal devices``' ``host_memory``), if any
    reason: str = ""
    #: the setting that turned pinning off on purpose (``KVHAL_PIN_HOST=off``), if one did
    turned_off: str | None = None

    def text(self) -> str:
        """The start line's field."""
        if self.pinned is None:
            return "host memory not known"
        if self.pinned:
            return "host memory pinned"
        return f"host memory pageable ({self.turned_off or 'see the warning'})"


def host_memory(descriptor: DeviceDescriptor | None) -> HostMemory:
    """What the selected plugin's probe (``descriptor``) says of host memory here."""
    if descriptor is None:
        return HostMemory(None)
    reason = descriptor.details.get("host_memory", "")
    if descriptor.supports(Capability.PINNED_HOST):
        return HostMemory(True, reason)
    for name, off in PINNING_OFF.items():
        # a setting counts where the plugin names it, or gives no reason of its own
        if (env.read(name) or "").strip().lower() == off and (name in reason or not reason):
            return HostMemory(False, reason, f"{name}={off}")
    return HostMemory(False, reason)


def pinning_warning(plugin: str, memory: HostMemory) -> str:
    """The warning for host memory that cannot be pinned here: what kvhal does instead, what
    it costs, and the fix (docs/deploy.md's "Pinned memory" says the same)."""
    said = f" ({memory.reason})" if memory.reason else ""
    return (
        f"kvhal: host memory cannot be pinned here: the device plugin {plugin} does not declare "
        f"host.pinned{said}. kvhal runs the host tier on pageable host memory instead; nothing "
        "is refused and every block stays correct, but copies between the KV cache and the host "
        "tier are slower (a GPU copies pageable memory through the driver's staging buffer, not "
        "by DMA), and under memory pressure the kernel may swap host-tier pages out, so a hit "
        "can wait for page faults. Fix: give the engine CAP_IPC_LOCK (Kubernetes: the vLLM "
        'container\'s securityContext.capabilities.add: ["IPC_LOCK"], as deploy/base does; '
        "Docker: --cap-add IPC_LOCK) or an unlimited RLIMIT_MEMLOCK (`ulimit -l unlimited`; "
        "Docker: --ulimit memlock=-1), or set KVHAL_PIN_HOST=off / KVHAL_CPU_MLOCK=0 to choose "
        "pageable memory without this warning (docs/deploy.md, Pinned memory)"
    )


def cpu_binding_warning(
    device_type: str | None, world_size: int, cpus: int, environ: Mapping[str, str] | None = None
) -> str | None:
    """The warning for vLLM's CPU backend leaving no core to its API server and scheduler.

    vLLM (0.32) reserves ``world_size`` cores for the processes beside its workers, and as many
    again whenever a KV connector is configured (for NIXL's threads). On ``cpus`` <= twice the
    workers' that reservation is dropped altogether: the workers' OpenMP threads are bound to
    every core, and the API server, the scheduler's busy loop and the clients then preempt a
    forward whose threads wait for each other (BENCHMARKS.md, "The OpenAI server path": 1.2-1.9x
    the returning turns' TTFT of vLLM alone on 2 cores, 1.12-1.15x with the reservation set). None
    where vLLM binds as it would without kvhal, or the user chose the binding."""
    environ = os.environ if environ is None else environ
    if device_type != "cpu" or environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0":
        return None  # one process: vLLM binds nothing and reserves nothing
    if (
        environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU")
        or environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto") != "auto"
    ):
        return None
    if cpus > 2 * world_size:
        return None  # vLLM reserves one core more than without a connector: a core, not the step
    return (
        f"kvhal: vLLM's CPU backend reserves {2 * world_size} of this engine's {cpus} cores when a "
        "KV connector is configured (one per worker more than without one, for NIXL) and, as that "
        "leaves its workers too few, reserves none: every core runs the forward's OpenMP threads, "
        "and the API server and the scheduler take them from it (on 2 cores the server's "
        "returning turns took 1.2-1.9x vLLM alone's and its decode steps 3-4x; 1.12-1.15x and "
        f"the same with the fix). Fix: set VLLM_CPU_NUM_OF_RESERVED_CPU={world_size} (the "
        "reservation vLLM makes without a connector), or bind the workers yourself with "
        "VLLM_CPU_OMP_THREADS_BIND"
    )


def _select(config: ConnectorConfig, device_type: str | None) -> tuple[str, DeviceDescriptor | None]:
    """The device plugin the workers will select, in words, and its probe's descriptor (they
    select it again, and their selection is the one that counts: a failure here is
    reported, never raised)."""
    try:
        selection = PluginRegistry().explain(config.device, device_type=device_type)
    except Exception as exc:  # the log line must not be what stops an engine
        return f"not known ({type(exc).__name__}: {exc})", None
    if selection.device is None:
        return f"none ({selection.error})", None
    device = selection.device
    return f"{device.plugin_name!r} ({device.distribution or 'distribution unknown'})", device.descriptor


def device_plugin(config: ConnectorConfig, device_type: str | None) -> str:
    """The device plugin the workers will select, in words (see :func:`_select`)."""
    return _select(config, device_type)[0]


def start_line(
    config: ConnectorConfig,
    device: str,
    versions: dict[str, str],
    extensions: dict[str, str | None],
    memory: HostMemory | None = None,
) -> str:
    """The one line: kvhal's version and its plugins', the device plugin, the C extensions
    (which are missing), whether host memory is pinned (``memory``, where known), the tiers
    with their sizes."""
    kvhal = versions.get("kvhal", "unknown")
    others = ", ".join(f"{name} {version}" for name, version in versions.items() if name != "kvhal")
    missing = [module for module, reason in extensions.items() if reason is not None]
    built = len(extensions) - len(missing)
    native = f"C extensions {built} of {len(extensions)} built"
    if missing:
        native += f" (missing: {', '.join(missing)}; slower paths run, see the warnings)"
    pinned = f"{memory.text()}; " if memory is not None else ""
    return (
        f"kvhal {kvhal}{f' ({others})' if others else ''}: device plugin {device}; {native}; "
        f"{pinned}tiers: {tiers_text(config)}"
    )


def log_start(logger: logging.Logger, config: ConnectorConfig, vllm_config: Any) -> None:
    """Log the start line once, a warning per C extension that was not built, and one if
    host memory cannot be pinned (unless a setting turned pinning off)."""
    device_config = getattr(vllm_config, "device_config", None)
    device_type = getattr(device_config, "device_type", None)
    extensions = build_info.extension_status()
    device, descriptor = _select(config, device_type)
    memory = host_memory(descriptor)
    logger.info("%s", start_line(config, device, build_info.distribution_versions(), extensions, memory))
    by_module = {ext.module: ext for ext in build_info.EXTENSIONS}
    for module, reason in extensions.items():
        if reason is not None:
            logger.warning("%s", build_info.missing_extension_warning(by_module[module], reason))
    if memory.pinned is False and memory.turned_off is None:
        logger.warning("%s", pinning_warning(device, memory))
    parallel = getattr(vllm_config, "parallel_config", None)
    world = int(getattr(parallel, "local_world_size", None) or getattr(parallel, "world_size", 1) or 1)
    binding = cpu_binding_warning(device_type, world, len(os.sched_getaffinity(0)))
    if binding is not None:
        logger.warning("%s", binding)
