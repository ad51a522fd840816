"""Finding device plugins and picking one.

Plugins come from the entry-point group ``kvhal.plugins`` (an entry point may
name a module, an object, or a class, which is instantiated without
arguments; what it names must implement kvhal hooks, else it is an error naming
the plugin, e.g. a module whose plugin is a class inside it); the CPU plugin is
built in. :mod:`kvhal.selection` picks one of them, strictest first: the device named by
argument or ``KVHAL_DEVICE``, else the present plugins serving the engine's torch device
type, else every present plugin; the highest ``priority`` wins, a tie is an error.
:mod:`kvhal.discovery` holds what loading reads and the messages for a refused plugin.

A plugin that fails to load, raises in its probe, or returns a malformed descriptor is an
error naming it, its distribution and the hook: kvhal never silently falls back to another
device. ``KVHAL_PLUGINS`` (allowlist) and ``KVHAL_DISABLE_PLUGINS``
(blocklist), comma-separated, decide which plugins load at all;
``KVHAL_DISABLE_PLUGIN_AUTOLOAD=1`` loads only the built-in one.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import pluggy

from kvhal import env, hookspecs
from kvhal.cpu import CPUPlugin
from kvhal.descriptor import DeviceDescriptor, Refusal
from kvhal.device import Device, PluginManager
from kvhal.discovery import (
    BUILTIN_DISTRIBUTION,
    ENTRY_POINT_GROUP,
    ENV_ALLOW,
    ENV_BLOCK,
    ENV_DEVICE,
    ENV_NO_AUTOLOAD,
    PluginInfo,
    distribution_of,
    is_wrapper,
    mismatched_hook,
    no_hooks_message,
    split_names,
)
from kvhal.errors import (
    KVHALError,
    MalformedResultError,
    MissingHookError,
    PluginError,
    PluginLoadError,
    TierError,
    ValidationError,
)
from kvhal.selection import ProbeOutcome, Selection, choose, why_not

T = TypeVar("T")
log = logging.getLogger(__name__)

BUILTIN_POLICIES = "kvhal-policies"
BUILTIN_TIERS = "kvhal-tiers"
BUILTIN_STORES = "kvhal-stores"
#: The built-in plugins of the layers above this one, as ``module:class``: read when a
#: registry is made, so that the layers import the registry and never the other way round.
BUILTIN_PLUGINS = {
    BUILTIN_POLICIES: "kvhal.offload.eviction:BuiltinPolicies",
    BUILTIN_TIERS: "kvhal.tiers.media:BuiltinTiers",
    BUILTIN_STORES: "kvhal.tiers.media:BuiltinStores",
}


@dataclass(frozen=True)
class NamedFactory:
    """One factory a plugin offers by name through a hook (a policy, a tier backend)."""

    name: str
    factory: Callable[..., Any]
    plugin: str
    distribution: str | None


def _builtin(path: str) -> object:
    """An instance of the class at ``module:class`` (a row of :data:`BUILTIN_PLUGINS`)."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)()


class PluginRegistry:
    """A pluggy manager holding kvhal's hookspecs and every plugin found.

    :param allow: only these plugin names load (default ``KVHAL_PLUGINS``).
    :param block: these never load (default ``KVHAL_DISABLE_PLUGINS``).
    :param autoload: load entry points (default: unless ``KVHAL_DISABLE_PLUGIN_AUTOLOAD``).
    """

    def __init__(
        self,
        *,
        allow: str | Iterable[str] | None = None,
        block: str | Iterable[str] | None = None,
        autoload: bool | None = None,
    ) -> None:
        self.allow = split_names(allow if allow is not None else env.read(ENV_ALLOW))
        self.block = split_names(block if block is not None else env.read(ENV_BLOCK)) or set()
        if autoload is None:
            autoload = (env.read(ENV_NO_AUTOLOAD) or "") not in ("1", "true", "yes")
        self.pm = PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.plugins: list[PluginInfo] = []
        self.register(CPUPlugin(), "cpu", BUILTIN_DISTRIBUTION)
        # Past allow/block (they choose devices: a manager must always find its
        # default policy), and not listed in self.plugins, the plugins found.
        for name, path in BUILTIN_PLUGINS.items():
            self.pm.register(_builtin(path), name=name)
        if autoload:
            self._load_entry_points()

    # -- loading ------------------------------------------------------------

    def _refusal_to_load(self, name: str) -> str | None:
        if name in self.block:
            return f"blocked by {ENV_BLOCK} or block="
        if self.allow is not None and name not in self.allow:
            return f"not in the allowlist {ENV_ALLOW} or allow= ({', '.join(sorted(self.allow))})"
        return None

    def _load_entry_points(self) -> None:
        seen: dict[str, tuple[str | None, str]] = {p.name: (p.distribution, "") for p in self.plugins}
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            dist = distribution_of(ep)
            if ep.name in seen:
                holder, value = seen[ep.name]
                if (holder, value) != (dist, ep.value):  # not one install found twice on sys.path
                    self._name_taken(ep, dist, holder)
                continue
            seen[ep.name] = (dist, ep.value)
            refusal = self._refusal_to_load(ep.name)
            if refusal:
                self.plugins.append(PluginInfo(ep.name, dist, blocked_by=refusal))
                continue
            try:
                obj = ep.load()
                if isinstance(obj, type):
                    obj = obj()
            except Exception as exc:  # any import-time failure is the plugin's
                error = PluginLoadError(
                    ep.name, dist, None, f"failed to import {ep.value!r}: {type(exc).__name__}: {exc}"
                )
                error.__cause__ = exc
                self.plugins.append(PluginInfo(ep.name, dist, error=error))
                continue
            self.register(obj, ep.name, dist)

    def _name_taken(self, ep: importlib.metadata.EntryPoint, dist: str | None, holder: str | None) -> None:
        """An entry point whose name an earlier plugin holds is not loaded: say so, never silently."""
        by = "kvhal's built-in plugin" if holder == BUILTIN_DISTRIBUTION else f"distribution {holder}"
        reason = (
            f"the name {ep.name!r} is taken by {by}, loaded first (sys.path order); a plugin's "
            "entry point name must be unique: rename it in its package's entry points"
        )
        log.warning("kvhal: entry point %r of %s (%s) not loaded: %s", ep.name, dist, ep.value, reason)
        self.plugins.append(PluginInfo(ep.name, dist, blocked_by=reason))

    def register(self, plugin: object, name: str, distribution: str | None = None) -> PluginInfo:
        """Register a plugin object (what entry points do; tests use it directly).

        A plugin whose hook impls do not match kvhal's specs is kept as an
        error entry (:class:`PluginLoadError` naming the hook), not registered.
        """
        refusal = self._refusal_to_load(name)
        if refusal:
            info = PluginInfo(name, distribution, blocked_by=refusal)
            self.plugins.append(info)
            return info
        info = PluginInfo(name, distribution)
        try:
            self.pm.register(plugin, name=name)
        except pluggy.PluginValidationError as exc:
            hook, reason = mismatched_hook(self.pm, plugin)
            info.error = PluginLoadError(name, distribution, hook, reason or " ".join(str(exc).split()))
            info.error.__cause__ = exc
            self.plugins.append(info)
            return info
        except ValueError as exc:  # duplicate name
            info.error = PluginLoadError(name, distribution, None, str(exc))
            self.plugins.append(info)
            return info
        callers = self.pm.get_hookcallers(plugin) or []
        unknown = [c.name for c in callers if c.spec is None and c.name.startswith("kvhal_")]
        if unknown:
            self.pm.unregister(plugin)
            info.error = PluginLoadError(
                name, distribution, unknown[0], f"implements {unknown} which kvhal does not define (a typo?)"
            )
        elif not any(c.name.startswith(f"{hookspecs.PROJECT}_") for c in callers):
            self.pm.unregister(plugin)
            info.error = PluginLoadError(name, distribution, None, no_hooks_message(plugin))
        else:
            info.plugin = plugin
        self.plugins.append(info)
        return info

    def call_one(self, hook: str, info: PluginInfo, **kwargs: Any) -> list[Any]:
        """Call ``hook`` on one plugin through pluggy's hook caller, so that wrappers
        (tracing, fault injection) see the call; its results, ``None`` left out."""
        caller = getattr(self.pm.hook, hook)
        others = [
            impl.plugin
            for impl in caller.get_hookimpls()
            if impl.plugin is not info.plugin and not is_wrapper(impl)
        ]
        result = self.pm.subset_hook_caller(hook, remove_plugins=others)(**kwargs)
        if caller.spec is not None and caller.spec.opts.get("firstresult"):
            return [] if result is None else [result]
        return list(result)

    def _info_of(self, plugin: object, name: str) -> PluginInfo:
        for info in self.plugins:
            if info.plugin is plugin:
                return info
        builtin = name in (BUILTIN_POLICIES, BUILTIN_TIERS, BUILTIN_STORES)
        distribution = BUILTIN_DISTRIBUTION if builtin else None
        return PluginInfo(name, distribution, plugin)

    # -- named factories -----------------------------------------------------

    def named_factories(self, hook: str, what: str) -> dict[str, NamedFactory]:
        """Merge the ``{name: factory}`` mappings every plugin offers through ``hook``.

        Each plugin is called through the hook caller (wrappers see it).

        :param what: what a factory makes, for messages (``"policy"``).
        :raises PluginError: a plugin's hook raised, or two plugins offer one name.
        :raises MalformedResultError: a plugin answered with something other
            than a mapping of names to callables.
        """
        found: dict[str, NamedFactory] = {}
        for impl in getattr(self.pm.hook, hook).get_hookimpls():
            if is_wrapper(impl):
                continue
            info = self._info_of(impl.plugin, impl.plugin_name)
            try:
                results = self.call_one(hook, info)
            except Exception as exc:
                raise PluginError(
                    info.name, info.distribution, hook, f"raised {type(exc).__name__}: {exc}"
                ) from exc
            for result in results:
                if not isinstance(result, Mapping) or not all(
                    isinstance(k, str) and callable(v) for k, v in result.items()
                ):
                    raise MalformedResultError(
                        info.name,
                        info.distribution,
                        hook,
                        f"returned {result!r:.80}; expected a mapping of name to factory",
                    )
                for name, factory in result.items():
                    if name in found:
                        other = found[name].plugin
                        raise PluginError(
                            info.name, info.distribution, hook, f"offers {what} {name!r}, as {other!r} does"
                        )
                    found[name] = NamedFactory(name, factory, info.name, info.distribution)
        return found

    def create_named(
        self,
        hook: str,
        name: str,
        args: Sequence[Any],
        *,
        expected: type[T],
        what: str,
        argument: str,
        label: str | None = None,
        passes: tuple[type[Exception], ...] = (),
    ) -> T:
        """``factory(*args)`` of the factory offered as ``name`` through ``hook``, checked.

        :param expected: the type the factory must return.
        :param what: what it makes, for messages (``"policy"``).
        :param label: a longer name for it in the unknown-name message (``"eviction policy"``).
        :param argument: the caller's argument that named it, for a :class:`ValidationError`.
        :param passes: more exceptions of the factory's that reach the caller as they are
            (``StoreUnavailable``: a store that is down is no fault of its plugin).
        :raises ValidationError: no plugin offers ``name`` (the message lists those known).
        :raises PluginError: the hook or the factory raised (names the plugin).
        :raises MalformedResultError: the factory returned something else than ``expected``.
        """
        offers = self.named_factories(hook, what)
        if name not in offers:
            known = ", ".join(sorted(offers)) or "none"
            raise ValidationError(argument, f"unknown {label or what} {name!r}; known: {known}")
        offer = offers[name]
        try:
            made = offer.factory(*args)
        except (ValidationError, TierError, *passes):
            raise  # it names the argument or the medium at fault already, or the caller expects it
        except Exception as exc:
            message = f"factory of {name!r} raised {type(exc).__name__}: {exc}"
            raise PluginError(offer.plugin, offer.distribution, hook, message) from exc
        if not isinstance(made, expected):
            raise MalformedResultError(
                offer.plugin,
                offer.distribution,
                hook,
                f"factory of {name!r} returned {type(made).__name__}; "
                f"expected an instance of {expected.__name__}",
            )
        return made

    # -- probing ------------------------------------------------------------

    def implemented_hooks(self, info: PluginInfo) -> set[str]:
        """The hooks ``info``'s plugin implements (wrappers around a hook do not count)."""
        if info.plugin is None:
            return set()
        return {
            caller.name
            for caller in self.pm.get_hookcallers(info.plugin) or []
            for impl in caller.get_hookimpls()
            if impl.plugin is info.plugin and not is_wrapper(impl)
        }

    def device_plugins(self) -> list[PluginInfo]:
        """Loaded plugins implementing ``kvhal_probe``, plus ones that failed to load."""
        return [p for p in self.plugins if p.error is not None or "kvhal_probe" in self.implemented_hooks(p)]

    def probe(self, info: PluginInfo) -> ProbeOutcome:
        if info.error is not None:
            return ProbeOutcome(info, reason=str(info.error), error=info.error)
        try:
            results = self.call_one("kvhal_probe", info)
            result = results[0] if len(results) == 1 else results or None
        except Exception as exc:
            error = PluginError(
                info.name, info.distribution, "kvhal_probe", f"raised {type(exc).__name__}: {exc}"
            )
            error.__cause__ = exc
            return ProbeOutcome(info, reason=str(error), error=error)
        if isinstance(result, DeviceDescriptor):
            return ProbeOutcome(info, descriptor=result)
        if isinstance(result, Refusal):
            return ProbeOutcome(info, reason=result.reason)
        error = MalformedResultError(
            info.name,
            info.distribution,
            "kvhal_probe",
            f"returned {type(result).__name__} {result!r}; expected DeviceDescriptor or Refusal",
        )
        return ProbeOutcome(info, reason=str(error), error=error)

    def probe_all(self) -> list[ProbeOutcome]:
        return [self.probe(p) for p in self.device_plugins()]

    # -- selection ----------------------------------------------------------

    def select(self, name: str | None = None, *, device_type: str | None = None) -> Device:
        """Pick the device plugin (see :mod:`kvhal.selection`) and bind a :class:`Device`."""
        selection = self.explain(name, device_type=device_type)
        if selection.error is not None:
            raise selection.error
        assert selection.device is not None
        return selection.device

    def explain(self, name: str | None = None, *, device_type: str | None = None) -> Selection:
        """Like :meth:`select`, but return the outcome (and every probe) instead of raising."""
        outcomes = self.probe_all()
        selection = Selection(outcomes)
        named_by = "argument" if name else ENV_DEVICE
        name = name or env.read(ENV_DEVICE)
        try:
            chosen, selection.why = choose(outcomes, self.plugins, name, device_type, named_by)
            selection.device = self._bind(chosen)
        except KVHALError as exc:
            selection.error = exc
        for outcome in outcomes:
            if selection.device is not None and outcome.info.name == selection.device.plugin_name:
                continue
            selection.others[outcome.info.name] = why_not(outcome, selection, device_type)
        return selection

    def _bind(self, outcome: ProbeOutcome) -> Device:
        info, descriptor = outcome.info, outcome.descriptor
        assert descriptor is not None and info.plugin is not None
        implemented = self.implemented_hooks(info)
        for hook in hookspecs.DEVICE_HOOKS:
            if hook not in implemented:
                raise MissingHookError(
                    info.name,
                    info.distribution,
                    hook,
                    "is required of every device plugin but not implemented",
                )
        others = [p.plugin for p in self.device_plugins() if p.plugin is not None and p is not info]
        return Device(self.pm, info.name, info.distribution, descriptor, others)


def select_device(
    name: str | None = None,
    *,
    device_type: str | None = None,
    allow: str | Iterable[str] | None = None,
    block: str | Iterable[str] | None = None,
) -> Device:
    """Discover plugins and return the selected :class:`Device` (see :mod:`kvhal.selection`)."""
    return PluginRegistry(allow=allow, block=block).select(name, device_type=device_type)
