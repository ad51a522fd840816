"""The plugin under test: how the suite finds it, binds it, and calls its raw hooks."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

import kvhal
from kvhal.descriptor import Capability, DeviceDescriptor
from kvhal.device import Device
from kvhal.discovery import BUILTIN_DISTRIBUTION, PluginInfo
from kvhal.errors import KVHALError
from kvhal.registry import PluginRegistry
from kvhal_conformance.footprint import Footprint, Snapshot

#: The test hook a plugin reports its device memory through.
MEMORY_HOOK = "kvhal_device_memory_in_use"

#: The optional attribute of a plugin object naming the attention backends its kernels serve
#: (``ATTENTION_BACKENDS = ("FLASH_ATTN", "MY_ATTN")``): the suite asks ``kvhal_kv_layouts`` about each.
BACKENDS_ATTRIBUTE = "ATTENTION_BACKENDS"


def load_object(spec: str) -> object:
    """``module:attr`` (attr may be dotted) -> the object; a class is instantiated."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise pytest.UsageError(f"--kvhal-plugin {spec!r}: expected MODULE:ATTR")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
        return obj() if isinstance(obj, type) else obj
    except Exception as exc:  # not importable, no such attribute, or its constructor raised
        raise pytest.UsageError(f"--kvhal-plugin {spec!r}: {type(exc).__name__}: {exc}") from exc


def _registry_for(name: str) -> PluginRegistry:
    """A registry for plugin objects registered as ``name``: installed plugins stay out (the
    built-in CPU plugin is always there)."""
    return PluginRegistry(autoload=False, allow={"cpu", name}, block=())


@dataclass
class Target:
    """The device plugin named by ``--kvhal-device``, found and (if it can be) bound.

    :param registry: holds the plugin (and the built-in CPU plugin).
    :param info: the plugin as the registry found it.
    :param descriptor: what its probe returned, when it returned a descriptor.
    :param device: the bound :class:`~kvhal.device.Device`, or None when binding failed.
    :param error: why binding failed (a missing hook, a refusal, a load error), naming the plugin.
    :param metrics: measurements the tests leave for the report (throughput).
    :param first_probe: what the plugin's first probe left behind (threads, host and device
        memory), measured around it when the target was bound (``probe.no_work``).
    """

    registry: PluginRegistry
    info: PluginInfo
    descriptor: DeviceDescriptor | None
    device: Device | None
    error: str | None
    metrics: dict[str, Any] = field(default_factory=dict)
    first_probe: Footprint | None = None
    #: checks failed because the plugin could not be bound (the reason is said in full once)
    unbound_failures: int = 0

    @classmethod
    def find(cls, name: str, plugin_specs: tuple[str, ...] = ()) -> Target:
        """Find the installed plugin ``name`` (``kvhal devices`` lists them), or register the
        objects ``MODULE:ATTR`` in ``plugin_specs`` as ``name``; an unknown name or an
        unloadable spec is a usage error."""
        if plugin_specs:
            if name == "cpu":
                raise pytest.UsageError("--kvhal-plugin: 'cpu' is built in; choose another --kvhal-device")
            registry = _registry_for(name)
            for spec in plugin_specs:
                obj = load_object(spec)
                version = getattr(importlib.import_module(spec.partition(":")[0]), "__version__", None)
                distribution = f"{spec} (--kvhal-plugin)" + (f" {version}" if version else "")
                registry.register(obj, name, distribution)
        else:
            registry = PluginRegistry()
        return cls._bind(registry, name)

    @classmethod
    def of_plugin(cls, plugin: object, name: str) -> Target:
        """Test the plugin object ``plugin`` (one not installed through an entry point, e.g. a
        class of your test suite, instantiated) under the name ``name``."""
        if name == "cpu":
            raise ValueError("Target.of_plugin: name 'cpu' is the built-in plugin's; choose another name")
        registry = _registry_for(name)
        kind = type(plugin)
        registry.register(plugin, name, f"{kind.__module__}.{kind.__qualname__}")  # no version
        return cls._bind(registry, name)

    @classmethod
    def _bind(cls, registry: PluginRegistry, name: str) -> Target:
        matches = [p for p in registry.plugins if p.name == name]
        if not matches:
            known = ", ".join(sorted(p.name for p in registry.plugins)) or "none"
            raise pytest.UsageError(f"--kvhal-device {name!r}: no such kvhal plugin; plugins found: {known}")
        info = matches[-1]
        if info.blocked_by:
            raise pytest.UsageError(f"--kvhal-device {name!r}: plugin not loaded ({info.blocked_by})")
        report = _memory_report(registry, info)
        before = Snapshot.take(report)  # before the plugin's first probe: what it keeps shows
        outcome = registry.probe(info)
        first_probe = Footprint.between(before, Snapshot.take(report))
        try:
            device = registry.select(name)
        except KVHALError as exc:
            return cls(registry, info, outcome.descriptor, None, str(exc), first_probe=first_probe)
        return cls(registry, info, device.descriptor, device, None, first_probe=first_probe)

    # -- naming ---------------------------------------------------------------

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def label(self) -> str:
        """``plugin 'NAME' (distribution ...)`` as kvhal's errors write it."""
        where = f"plugin {self.name!r}"
        return where + (f" (distribution {self.info.distribution})" if self.info.distribution else "")

    @property
    def version(self) -> str | None:
        """The plugin's version: its distribution's, or kvhal's for the built-in one."""
        dist = self.info.distribution
        if dist == BUILTIN_DISTRIBUTION:
            return kvhal.__version__
        if dist and " " in dist and "--kvhal-plugin" not in dist:
            return dist.rsplit(" ", 1)[1]
        return None

    # -- what tests use -------------------------------------------------------

    def require_device(self) -> Device:
        """The bound device, or fail the calling test with why it could not be bound: the whole
        reason at the first check, a short line naming it at the others (a run of a plugin that
        cannot be bound would repeat it in every check; :meth:`unbound_summary` gives the count)."""
        if self.device is None:
            self.unbound_failures += 1
            if self.unbound_failures == 1:
                pytest.fail(f"{self.label} could not be bound, nothing else can be checked: {self.error}")
            pytest.fail(f"{self.label} could not be bound (the reason is given once, at the first check)")
        return self.device

    def unbound_summary(self) -> str | None:
        """``N checks failed: PLUGIN could not be bound: WHY``, once per run, or None."""
        if not self.unbound_failures:
            return None
        return f"{self.unbound_failures} checks failed: {self.label} could not be bound: {self.error}"

    def declared_backends(self) -> tuple[str, ...]:
        """The attention backend names the plugin declares in its optional ``ATTENTION_BACKENDS``
        attribute (a sequence of non-empty str; none: ``()``); ValueError, saying what was
        expected, when the declaration is malformed."""
        declared = getattr(self.info.plugin, BACKENDS_ATTRIBUTE, ())
        if isinstance(declared, str) or not all(isinstance(n, str) and n for n in declared or ()):
            raise ValueError(
                f"{self.label} declares {BACKENDS_ATTRIBUTE} = {declared!r}; expected a sequence of "
                'non-empty attention backend names, e.g. ("FLASH_ATTN", "MY_ATTN")'
            )
        return tuple(dict.fromkeys(declared or ()))

    def declares(self, capability: Capability | str) -> bool:
        return self.descriptor is not None and self.descriptor.supports(capability)

    def require(self, capability: Capability | str) -> None:
        """Skip the calling test, naming the capability, unless the plugin declares it."""
        self.require_device()
        value = capability.value if isinstance(capability, Capability) else capability
        if not self.declares(value):
            pytest.skip(f"capability {value} not declared by plugin {self.name!r}")

    def caller(self, hook: str) -> Any:
        """Hook ``hook`` of this plugin alone (plus non-device wrappers), without kvhal's checks."""
        return _own_caller(self.registry, self.info, hook)

    def call(self, hook: str, **kwargs: Any) -> Any:
        """Call :meth:`caller`; an exception fails the calling test, naming plugin and hook."""
        try:
            return self.caller(hook)(**kwargs)
        except Exception as exc:
            args = ", ".join(f"{k}={v!r:.60}" for k, v in kwargs.items())
            pytest.fail(
                f"{self.label} hook {hook}({args}) raised {type(exc).__name__}: {exc}: the hook must "
                "keep the promises kvhal.hookspecs lists for it (raising here is none of them)"
            )


def _memory_report(registry: PluginRegistry, info: PluginInfo) -> Callable[[], int | None]:
    """The plugin's ``kvhal_device_memory_in_use`` (its alone): an int, or None where it has
    none, raised, or answered something else (``memory.report`` judges that)."""
    caller = _own_caller(registry, info, MEMORY_HOOK)

    def report() -> int | None:
        try:
            found = caller()
        except Exception:
            return None
        return found if isinstance(found, int) and not isinstance(found, bool) else None

    return report


def _own_caller(registry: PluginRegistry, info: PluginInfo, hook: str) -> Any:
    """Hook ``hook`` of the plugin ``info`` alone (plus non-device wrappers)."""
    others = [p.plugin for p in registry.device_plugins() if p.plugin is not None and p is not info]
    return registry.pm.subset_hook_caller(hook, remove_plugins=others)
