"""kvhal's error types.

Every error a plugin can cause names the culprit: the plugin, the distribution
that ships it, and the hook. Validation errors name the argument. All of them
are raised before any byte moves, except :class:`TransferError`, which reports
a copy that failed while it ran.

A device plugin raises two of them on purpose: :class:`ValidationError` from
``kvhal_allocate_kv_cache`` for what the device cannot hold, and
:class:`TransferError` from ``kvhal_query_event``/``kvhal_synchronize_event``
for a failed copy. kvhal wraps anything else a hook raises in a
:class:`PluginError` naming the plugin, its distribution and the hook.
"""

from __future__ import annotations


class KVHALError(Exception):
    """Base class of every error kvhal raises on purpose."""


class ValidationError(KVHALError, ValueError):
    """An argument is invalid; nothing was done.

    ``ValidationError(argument, message)``; ``str()`` is ``"argument: message"``.
    A plugin raising it from a hook reaches its caller as a
    :class:`PluginValidationError`.

    :param argument: the name of the offending argument (``"layout"``, ``"geometry"``).
    :param message: what is wrong with it.
    """

    def __init__(self, argument: str, message: str) -> None:
        self.argument = argument
        Exception.__init__(self, f"{argument}: {message}")


class LayoutError(ValidationError):
    """A KV layout is malformed (e.g. its stride order is not a permutation)."""


class CopyValidationError(ValidationError):
    """A block copy was refused before any byte moved (bad ids, mismatched caches, an
    undeclared capability). ``CopyValidationError(argument, message)``, as
    :class:`ValidationError`."""


class BlockStateError(KVHALError):
    """Keys are not in the state an offloading-manager call needs (unknown, not
    ready, no load in flight, store already completed); nothing was changed.

    A state, not a bad value: not a :class:`ValueError`.

    :param argument: the argument holding the keys (``"keys"``).
    """

    def __init__(self, argument: str, message: str) -> None:
        self.argument = argument
        super().__init__(f"{argument}: {message}")


class ClosedError(KVHALError):
    """The object (a host tier, a transfer engine) was closed; it cannot be used any more.

    :param what: what was closed, e.g. ``"host tier"``.
    """

    def __init__(self, what: str) -> None:
        self.what = what
        super().__init__(f"the {what} is closed")


class PolicyError(KVHALError):
    """An eviction policy broke its contract (e.g. chose a block in use); see
    :class:`kvhal.offload.eviction_policy.EvictionPolicy`."""


def plugin_hook_label(plugin: str, distribution: str | None, hook: str | None) -> str:
    """``plugin 'NAME' (distribution D), hook H``: how kvhal's messages name a plugin's hook."""
    where = f"plugin {plugin!r}"
    if distribution:
        where += f" (distribution {distribution})"
    if hook:
        where += f", hook {hook}"
    return where


class PluginError(KVHALError):
    """A device plugin failed to load, misbehaved, or returned a malformed result.

    ``PluginError(plugin, distribution, hook, message)``; ``str()`` is
    ``"plugin 'NAME' (distribution D), hook H: message"``. kvhal raises it (and its
    subclasses) about a plugin; a plugin does not raise it.

    :param plugin: the plugin's registered name (its entry point's name).
    :param distribution: ``name version`` of the distribution shipping it, or
        ``"kvhal (built-in)"``.
    :param hook: the hook involved, or ``None`` when the plugin failed to load.
    :param message: what happened.
    """

    def __init__(self, plugin: str, distribution: str | None, hook: str | None, message: str) -> None:
        self.plugin = plugin
        self.distribution = distribution
        self.hook = hook
        Exception.__init__(self, f"{plugin_hook_label(plugin, distribution, hook)}: {message}")


class PluginLoadError(PluginError):
    """A plugin's entry point could not be imported or registered (an import error, a hook
    taking an argument its spec lacks, a ``kvhal_*`` name kvhal does not define).
    Constructor as :class:`PluginError`; ``hook`` is ``None`` for an import error."""


class MissingHookError(PluginError):
    """A device plugin does not implement a hook every device plugin must implement
    (raised when it is selected). Constructor as :class:`PluginError`."""


class PluginValidationError(PluginError, ValidationError):
    """A plugin refused an argument (it raised :class:`ValidationError`); nothing was done.

    Both a :class:`PluginError` naming the plugin and hook and a
    :class:`ValidationError` naming the argument, so callers that handle bad
    input catch it either way.
    """

    def __init__(
        self, plugin: str, distribution: str | None, hook: str | None, refusal: ValidationError
    ) -> None:
        PluginError.__init__(self, plugin, distribution, hook, str(refusal))
        self.argument = refusal.argument


class MalformedResultError(PluginError):
    """A hook returned something that breaks its contract (``None`` from a hook that
    must answer, a result of the wrong type). Constructor as :class:`PluginError`."""


class DeviceSelectionError(KVHALError):
    """No device plugin could be selected (none present, a tie of priorities, or the named
    one declined). ``DeviceSelectionError(message)``."""


class TierError(KVHALError):
    """A tier's medium cannot be used as asked: another engine owns it, or it is unsafe.

    :param tier: the tier backend's name (``"disk"``).
    :param where: the medium (a path, a store's address).
    """

    def __init__(self, tier: str, where: str, message: str) -> None:
        self.tier = tier
        self.where = where
        Exception.__init__(self, f"{tier} tier at {where}: {message}")


class TransferError(KVHALError):
    """An asynchronous block copy failed; the destination blocks hold no valid KV.

    ``TransferError(message)``: one argument, the message (say what failed and why;
    raise it ``from`` the underlying error). A device plugin raises it from
    ``kvhal_query_event`` and ``kvhal_synchronize_event`` for the event of a copy
    that failed, on every call until the event is recorded again; kvhal raises it on
    as a TransferError whose message names the plugin and the hook first, and the
    transfer engine reports the blocks for recompute.
    """


def check_int(
    argument: str,
    value: object,
    *,
    minimum: int | None = 1,
    below: int | None = None,
    message: str | None = None,
) -> int:
    """``value`` if it is an ``int`` (a ``bool`` is not) in ``[minimum, below)``, else a
    :class:`ValidationError` naming ``argument``.

    :param minimum: the smallest value allowed (default 1: a positive int); ``None`` for no bound.
    :param below: the first value not allowed above, or ``None``.
    :param message: the error's text, formatted with ``value`` (``"slot {value!r} ..."``);
        by default it says what was expected.
    """
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or (minimum is not None and value < minimum)
        or (below is not None and value >= below)
    ):
        if message is None:
            if below is not None:
                message = f"{{value!r}} is not in [{minimum}, {below})"
            elif minimum == 1:
                message = "must be a positive int, got {value!r}"
            elif minimum is not None:
                message = f"must be an int >= {minimum}, got {{value!r}}"
            else:
                message = "must be an int, got {value!r}"
        raise ValidationError(argument, message.format(value=value))
    return value
