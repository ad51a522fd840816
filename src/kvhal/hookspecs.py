"""Every contract between kvhal and its plugins, in one place.

kvhal uses pluggy (project name ``kvhal``). Device plugins are found through
the entry-point group ``kvhal.plugins`` (the CPU plugin is built in) and
implement the *device hooks* below. kvhal calls a device hook only on the one
device plugin it selected, plus any non-device plugin that wraps the hook (a
``hookwrapper``/``wrapper`` impl, say to trace or to inject faults).

Any plugin, device or not, may also offer eviction policies (the last hook,
``kvhal_eviction_policies``); it is no device hook.

Every device hook is required: a device plugin that lacks one is refused at
selection with :class:`~kvhal.errors.MissingHookError` naming the plugin and
the hook. Results are checked; a malformed one raises
:class:`~kvhal.errors.MalformedResultError` naming plugin, distribution and
hook. Helpers a plugin can build on: :func:`kvhal.cache.allocate_dense_kv_cache`,
:func:`kvhal.cache.dense_kv_cache`, :class:`kvhal.copyplan.CopyPlan`.

Vocabulary (vLLM 0.32): logical KV dims ``[L, B, H, N, C]`` = layers,
blocks, heads, tokens per block, content; see :mod:`kvhal.layouts`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    import torch

    from kvhal.cache import KVCache
    from kvhal.copyplan import CopyPlan
    from kvhal.descriptor import DeviceDescriptor, Refusal
    from kvhal.eviction_policy import EvictionPolicy
    from kvhal.geometry import KVGeometry
    from kvhal.layouts import KVLayout

PROJECT = "kvhal"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

# --------------------------------------------------------------------------
# Probing
# --------------------------------------------------------------------------


@hookspec
def kvhal_probe() -> DeviceDescriptor | Refusal:
    """Say whether this plugin's hardware is here.

    Called once per device plugin, each separately, when kvhal lists or
    selects devices. Must not allocate device memory or start device work
    beyond what detection needs; must not raise for absent hardware.

    :return: a :class:`~kvhal.descriptor.DeviceDescriptor` when the device is
        present and usable, else a :class:`~kvhal.descriptor.Refusal` with
        the reason (shown by ``kvhal devices``). Anything else, or an
        exception, is an error naming the plugin; kvhal never falls back to
        another device because of it.
    """


# --------------------------------------------------------------------------
# KV layouts
# --------------------------------------------------------------------------


@hookspec(firstresult=True)
def kvhal_kv_layouts(attention_backend: str | None) -> Sequence[KVLayout]:
    """The KV layouts this device's attention kernels accept, preferred first.

    Each :class:`~kvhal.layouts.KVLayout` carries its stride order over
    ``[L, B, H, N, C]``; its ``layer_view_order`` is the order without the
    layers dimension. Layouts starting with ``B`` are cross-layer.

    :param attention_backend: the engine's attention backend name (vLLM's,
        e.g. ``"FLASH_ATTN"``, ``"ROCM_ATTN"``, ``"CPU_ATTN"``) or ``None``
        for the device's default kernels.
    :return: a non-empty sequence of layouts. Stop at first non-None result.
    """


# --------------------------------------------------------------------------
# Allocation
# --------------------------------------------------------------------------


@hookspec(firstresult=True)
def kvhal_allocate_kv_cache(geometry: KVGeometry, layout: KVLayout, device: torch.device) -> KVCache:
    """Allocate a zeroed KV cache for ``geometry`` in ``layout`` on ``device``.

    The result's per-layer views are logical ``[B, H, N, C]`` (a (K, V) pair
    for :attr:`~kvhal.geometry.KVFormat.SPLIT`), over one buffer (or one per
    part where the device needs separately aligned K and V) whose physical
    order is ``layout``; in a cross-layer layout one block of every layer is
    one contiguous region. Its ``geometry`` and ``layout`` equal the ones
    asked for.

    :raises kvhal.errors.ValidationError: a layout or format the device
        cannot hold (name the argument).
    :return: a :class:`~kvhal.cache.KVCache`. Stop at first non-None result.
    """


# --------------------------------------------------------------------------
# Host memory
# --------------------------------------------------------------------------


@hookspec(firstresult=True)
def kvhal_allocate_host_buffer(nbytes: int) -> torch.Tensor:
    """Allocate ``nbytes`` of host memory the device copies to and from fastest.

    Pinned (page-locked) or registered with the device where it can be, else
    the device's best equivalent. Pinning may finish in the background after
    the buffer is returned (copies must be correct meanwhile, only slower, and
    :func:`kvhal_host_buffer_is_pinned` says ``False`` until it has) only
    where that cannot disturb the engine: on CUDA and ROCm a runtime call from
    any thread breaks the graph capture vLLM starts right after registering
    its KV caches (vLLM #46933), so their plugins pin before returning. A plugin
    declaring ``host.pinned`` pins every buffer within a bounded time (the
    conformance suite waits 60 s).

    :return: a flat CPU byte tensor (``int8``/``uint8``) of at least
        ``nbytes``, zeroed, whose address is 4096-byte aligned. Stop at first
        non-None result.
    """


@hookspec
def kvhal_free_host_buffer(buffer: torch.Tensor) -> None:
    """Release a buffer from :func:`kvhal_allocate_host_buffer` (unpin/unregister).

    Called at most once per buffer; the caller drops its views first.
    """


@hookspec(firstresult=True)
def kvhal_host_buffer_is_pinned(buffer: torch.Tensor) -> bool:
    """Whether ``buffer`` is page-locked as this device defines it (pinned,
    registered, or locked). Stop at first non-None result."""


# --------------------------------------------------------------------------
# Streams and events
# --------------------------------------------------------------------------


@hookspec(firstresult=True)
def kvhal_create_stream(device: torch.device) -> Any:
    """A new stream for copies: work submitted to it runs in submission
    order, asynchronously to the caller. Stop at first non-None result."""


@hookspec(firstresult=True)
def kvhal_current_stream(device: torch.device) -> Any:
    """The stream the engine's compute (attention, KV writes) runs on.

    Copies are ordered after it (stores read KV it writes; loads write blocks
    it may still zero), so it must be the real one. Stop at first non-None result.
    """


@hookspec(firstresult=True)
def kvhal_create_event(device: torch.device) -> Any:
    """A new, unrecorded event: querying it reports complete. Stop at first non-None result."""


@hookspec
def kvhal_record_event(event: Any, stream: Any) -> None:
    """Record ``event`` on ``stream``: it completes when all work submitted
    to ``stream`` before this call has completed."""


@hookspec(firstresult=True)
def kvhal_query_event(event: Any) -> bool:
    """Whether the work before ``event``'s last record has completed, without blocking.

    :raises kvhal.errors.TransferError: the copy it follows failed.
    :return: ``True`` or ``False``. Stop at first non-None result.
    """


@hookspec
def kvhal_synchronize_event(event: Any) -> None:
    """Block until ``event`` completes.

    :raises kvhal.errors.TransferError: the copy it follows failed.
    """


@hookspec
def kvhal_stream_wait_event(stream: Any, event: Any) -> None:
    """Make work submitted to ``stream`` after this call wait for ``event``'s
    last record (without blocking the caller)."""


# --------------------------------------------------------------------------
# Copies
# --------------------------------------------------------------------------


@hookspec(firstresult=True)
def kvhal_copy_blocks(plan: CopyPlan, stream: Any) -> Any:
    """Enqueue a checked block copy on ``stream`` and return an event recorded after it.

    ``plan`` was validated by kvhal (ids in range, unique destinations, same
    geometry and layout); it holds the ``(src, dst)`` block pairs, their runs
    of consecutive ids, and byte descriptors ``(src_ptrs, dst_ptrs, sizes)``
    with runs already coalesced. The copy reads ``plan.src`` and writes only
    the destination blocks of ``plan.dst``; it must not start before work
    submitted to ``stream`` earlier.

    :return: an event (as from :func:`kvhal_create_event`) that completes when
        every byte is written; a failure surfaces as
        :class:`~kvhal.errors.TransferError` from querying or synchronizing it.
        Stop at first non-None result.
    """


#: Hooks every device plugin must implement (all of the above).
DEVICE_HOOKS: tuple[str, ...] = (
    "kvhal_probe",
    "kvhal_kv_layouts",
    "kvhal_allocate_kv_cache",
    "kvhal_allocate_host_buffer",
    "kvhal_free_host_buffer",
    "kvhal_host_buffer_is_pinned",
    "kvhal_create_stream",
    "kvhal_current_stream",
    "kvhal_create_event",
    "kvhal_record_event",
    "kvhal_query_event",
    "kvhal_synchronize_event",
    "kvhal_stream_wait_event",
    "kvhal_copy_blocks",
)


# --------------------------------------------------------------------------
# Eviction policies (not a device hook: any plugin may offer policies)
# --------------------------------------------------------------------------


@hookspec
def kvhal_eviction_policies() -> Mapping[str, Callable[[int], EvictionPolicy]]:
    """Eviction policies this plugin offers to offloading managers, by name.

    Not a device hook: kvhal calls it on every registered plugin, device or
    not, and merges the answers; the built-in ``lru`` and ``s3fifo`` come
    from a built-in plugin through this same hook. An
    :class:`~kvhal.manager.OffloadingManager` picks a policy by name
    (:func:`kvhal.eviction.create_policy`); an unknown name is an error
    listing the known ones.

    :return: a mapping from policy name to a factory: ``factory(num_slots)``
        returns a fresh :class:`~kvhal.eviction_policy.EvictionPolicy` for a manager
        of ``num_slots`` slots. A name offered by two plugins is an error
        naming both; a result that is not such a mapping, or a factory that
        returns something else, is a
        :class:`~kvhal.errors.MalformedResultError` naming the plugin. Every
        plugin's result is used (not first-result).
    """
