"""Finding plugins: the entry points, the allow and block lists, and why a plugin is refused.

What :class:`~kvhal.registry.PluginRegistry` reads before it registers anything, and the
messages for a plugin it cannot register (no kvhal hook, a hook taking an argument its spec
lacks), each saying what was probably meant.
"""

from __future__ import annotations

import importlib.metadata
import inspect
from collections.abc import Iterable
from dataclasses import dataclass

import pluggy

from kvhal import hookspecs
from kvhal.errors import PluginError

ENTRY_POINT_GROUP = "kvhal.plugins"
ENV_DEVICE = "KVHAL_DEVICE"
ENV_ALLOW = "KVHAL_PLUGINS"
ENV_BLOCK = "KVHAL_DISABLE_PLUGINS"
ENV_NO_AUTOLOAD = "KVHAL_DISABLE_PLUGIN_AUTOLOAD"
BUILTIN_DISTRIBUTION = "kvhal (built-in)"


@dataclass
class PluginInfo:
    """A plugin kvhal found, loaded or not."""

    name: str
    distribution: str | None
    plugin: object | None = None
    error: PluginError | None = None
    blocked_by: str | None = None

    @property
    def loaded(self) -> bool:
        return self.plugin is not None


def split_names(value: str | Iterable[str] | None) -> set[str] | None:
    """The names of a comma-separated list (``KVHAL_PLUGINS``) or an iterable; ``None`` kept."""
    if value is None:
        return None
    if isinstance(value, str):
        return {v.strip() for v in value.split(",") if v.strip()}
    return set(value)


def is_wrapper(impl: pluggy.HookImpl) -> bool:
    """Whether ``impl`` wraps a hook (tracing, fault injection) rather than answering it."""
    return bool(impl.hookwrapper or getattr(impl, "wrapper", False))


def distribution_of(ep: importlib.metadata.EntryPoint) -> str | None:
    """``"name version"`` of the distribution offering ``ep``, if known."""
    dist = getattr(ep, "dist", None)
    return f"{dist.name} {dist.version}" if dist is not None else None


def _hook_carriers(module: object) -> list[str]:
    """Attributes of ``module`` defined there that carry kvhal hook implementations."""
    found = []
    for attr, value in sorted(vars(module).items()):
        if attr.startswith("_") or getattr(value, "__module__", None) != getattr(module, "__name__", None):
            continue
        owner = value if isinstance(value, type) else type(value)
        if any(
            callable(member) and hasattr(member, f"{hookspecs.PROJECT}_impl")
            for key, member in inspect.getmembers(owner)
            if key.startswith(f"{hookspecs.PROJECT}_")
        ):
            found.append(attr)
    return found


def no_hooks_message(plugin: object) -> str:
    """Why a plugin that implements no kvhal hook is refused, and what was probably meant."""
    if not inspect.ismodule(plugin):
        return (
            f"registers no kvhal hooks: {type(plugin).__name__} has no method marked with "
            "kvhal.hookspecs.hookimpl, so kvhal cannot ask it anything"
        )
    carriers = _hook_carriers(plugin)
    hint = (
        "; name the plugin object in the entry point instead: "
        + " or ".join(f"'{plugin.__name__}:{attr}'" for attr in carriers)
        if carriers
        else ""
    )
    return (
        f"registers no kvhal hooks: it is the module {plugin.__name__!r}, which defines no function "
        f"marked with kvhal.hookspecs.hookimpl{hint}"
    )


def mismatched_hook(pm: pluggy.PluginManager, plugin: object) -> tuple[str | None, str | None]:
    """The hook whose implementation pluggy refused and why, in one line: it takes an
    argument its spec lacks. ``(None, None)`` when none such is found."""
    for attr in dir(plugin):
        prefixed = attr.startswith(f"{hookspecs.PROJECT}_")
        if not prefixed or pm.parse_hookimpl_opts(plugin, attr) is None:
            continue
        caller = getattr(pm.hook, attr, None)
        spec = getattr(caller, "spec", None)
        if spec is None:
            continue
        try:
            parameters = inspect.signature(getattr(plugin, attr)).parameters
        except (TypeError, ValueError):
            return attr, "has no signature kvhal can read"
        extra = [p for p in parameters if p not in spec.argnames]
        if extra:
            return attr, (
                f"takes argument(s) {', '.join(map(repr, extra))}, which the hookspec "
                f"{attr}({', '.join(spec.argnames)}) does not define: an implementation takes the "
                "spec's arguments by name (any subset of them)"
            )
    return None, None
