"""Every contract between kvhal and its plugins, in one place.

kvhal uses pluggy (project name ``kvhal``). Device plugins are found through
the entry-point group ``kvhal.plugins`` (the CPU plugin is built in) and
implement the *device hooks* below. kvhal calls a device hook only on the one
device plugin it selected, plus any non-device plugin that wraps the hook (a
``hookwrapper``/``wrapper`` impl, say to trace or to inject faults).

Any plugin, device or not, may also offer pinning witnesses
(``kvhal_pinning_witnesses``), eviction policies (``kvhal_eviction_policies``),
tier backends (``kvhal_tier_backends``) and remote stores
(``kvhal_remote_stores``, the last hook); they are no device hooks.

A device plugin may also implement the test hooks ``kvhal_inject_device_fault`` and
``kvhal_device_memory_in_use`` (:data:`TEST_HOOKS`), which only the conformance suite calls.

Every device hook is required: a device plugin that lacks one is refused at
selection with :class:`~kvhal.errors.MissingHookError` naming the plugin and
the hook. Results are checked; a malformed one raises
:class:`~kvhal.errors.MalformedResultError` naming plugin, distribution and
hook. Helpers a plugin can build on: :func:`kvhal.cache.allocate_dense_kv_cache`,
:func:`kvhal.cache.dense_kv_cache`, :class:`kvhal.copyplan.CopyPlan`.

Implementing a hook: a function or method named as below, decorated with
:data:`hookimpl` (``kvhal.hookimpl``), on the object an entry point names (a
class, instantiated once without arguments; an instance; or a module, whose
functions are the hooks). kvhal passes arguments by keyword under the names
below: an implementation may take any subset of them, in any order, and one
taking an argument the spec lacks is refused when it loads. A hook marked
"Stop at first non-None result" must return a value. Hooks may be called from
any thread. docs/vendor-guide.md walks through a whole plugin.

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
    from kvhal.geometry import KVGeometry
    from kvhal.layouts import KVLayout
    from kvhal.witness import PinningWitness

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
    selects devices.

    Promises (the conformance suite checks each one under its id):

    - ``probe.result``: returns a :class:`~kvhal.descriptor.DeviceDescriptor`
      when the device is present and usable, else a
      :class:`~kvhal.descriptor.Refusal` with the reason (shown by
      ``kvhal devices``); it must not raise, also when the hardware is absent.
    - ``probe.descriptor``: the descriptor's torch device type is one torch
      knows, and every capability is a :class:`~kvhal.descriptor.Capability`
      value or ``dtype.<torch dtype>``.
    - ``probe.no_work``: it must not allocate device memory or start device
      work (streams, threads) beyond what detection needs.

    Naming and selection: the plugin's name is its entry point's name, which
    ``KVHAL_DEVICE`` and :func:`kvhal.select_device` take; the descriptor's
    ``name`` is what users read and need not match it. Among present plugins
    (of the torch device type asked for, if any) the highest ``priority``
    wins and a tie is an error, so a plugin that is not the default one for
    its device type takes a priority below that one's (negative ones are
    allowed; the CPU plugin uses 0) and is chosen by name.

    :return: the descriptor or refusal. Anything else, or an exception, is an
        error naming the plugin; kvhal never falls back to another device
        because of it.
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

    Promises (the conformance suite checks each one under its id):

    - ``layouts.sequence``: a non-empty sequence of
      :class:`~kvhal.layouts.KVLayout`, for ``None`` and for each of the
      engine's attention backend names.
    - ``layouts.permutation``: every layout's stride order is a permutation
      of ``[L, B, H, N, C]``.
    - ``layouts.cross_layer``: cross-layer layouts are offered only by a
      plugin declaring ``layout.cross_layer``, and such a plugin offers at
      least one for ``None``.
    - ``layouts.backend``: every layout answered for a backend name (vLLM's, and
      the ones the plugin declares in its optional ``ATTENTION_BACKENDS`` attribute)
      is in the default answer (``None``) and allocatable
      (``kvhal_allocate_kv_cache`` allocates it).

    ``layouts.cross_layer`` obliges the default answer (``None``) only: for a
    backend name, a plugin declaring ``layout.cross_layer`` may answer
    layer-separate layouts alone when those kernels read nothing else. kvhal
    allocates only layouts in the default answer, so that answer should hold
    every layout any backend's answer holds.

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

    Promises (the conformance suite checks each one under its id):

    - ``alloc.as_asked``: the cache's ``geometry`` (its dtype and K/V format
      included), ``layout`` and device type equal the ones asked for, for
      every dtype and format the plugin declares.
    - ``alloc.zeroed``: every byte is zero, whatever the cache's size.
    - ``alloc.layout``: every layer's view is logical ``[B, H, N, C]`` (a
      (K, V) pair for :attr:`~kvhal.geometry.KVFormat.SPLIT`) with the same
      strides, over one buffer (or one per part where the device needs
      separately aligned K and V) whose physical order is ``layout``.
    - ``alloc.cross_layer``: in a cross-layer layout one block of every layer
      is one contiguous region.
    - ``alloc.distinct``: every element has its own memory; no two layers,
      blocks or parts share any.
    - ``alloc.refuses``: a layout, format or dtype the device cannot hold
      raises :class:`~kvhal.errors.ValidationError` naming the argument
      (anything else it returns must keep the promises above).

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

    Promises (the conformance suite checks each one under its id):

    - ``host.buffer``: a flat CPU byte tensor (``int8``/``uint8``) of at
      least ``nbytes``, for any positive size, from one byte and odd sizes to
      a whole host tier.
    - ``host.aligned``: its address is 4096-byte aligned.
    - ``host.zeroed``: every byte is zero, also when it reuses the memory of
      a freed buffer.
    - ``host.distinct``: buffers alive at the same time share no memory.
    - ``host.pinned``: a plugin declaring ``host.pinned`` pins every buffer
      (:func:`kvhal_host_buffer_is_pinned` says ``True``), within the time
      stated above.

    :return: a flat CPU byte tensor (``int8``/``uint8``) of at least
        ``nbytes``, zeroed, whose address is 4096-byte aligned. Stop at first
        non-None result.
    """


@hookspec
def kvhal_free_host_buffer(buffer: torch.Tensor) -> None:
    """Release a buffer from :func:`kvhal_allocate_host_buffer` (unpin/unregister).

    Called at most once per buffer; the caller drops its views first.

    Promises (the conformance suite checks each one under its id):

    - ``free.release``: it returns, raising nothing, for every buffer
      :func:`kvhal_allocate_host_buffer` returned, whatever its size and pin
      state.
    """


@hookspec(firstresult=True)
def kvhal_host_buffer_is_pinned(buffer: torch.Tensor) -> bool:
    """Whether ``buffer`` is page-locked as this device defines it (pinned,
    registered, or locked).

    Promises (the conformance suite checks each one under its id):

    - ``pinned.bool``: answers ``True`` or ``False`` for any CPU tensor, one
      of its own buffers or not.
    - ``pinned.truthful``: ``True`` only for memory this plugin pinned or
      registered: a plain torch tensor is ``False``.
    - ``pinned.witness``: for a plugin declaring ``host.pinned``, every byte
      of a buffer it says is pinned is pinned as a witness of its torch
      device type sees it (:func:`kvhal_pinning_witnesses`: the kernel's
      ``smaps`` for ``mlock``, the runtime's pointer attributes for CUDA and
      HIP), at every size up to gigabytes.

    Stop at first non-None result.
    """


# --------------------------------------------------------------------------
# Streams and events
# --------------------------------------------------------------------------


@hookspec(firstresult=True)
def kvhal_create_stream(device: torch.device) -> Any:
    """A new stream for copies.

    Promises (the conformance suite checks each one under its id):

    - ``stream.new``: every call returns a new stream, never one returned
      before.
    - ``stream.order``: work submitted to it (copies, event records, waits)
      runs in submission order, asynchronously to the caller: a later copy
      sees everything an earlier one wrote.

    A stream is any object; kvhal only passes it back to this plugin's hooks.
    There is no destroy hook: a stream lives as long as kvhal holds it (as
    long as the device facade or transfer engine that made it), and its
    resources are released when it is garbage-collected; work already
    submitted to it still runs to the end.

    Stop at first non-None result.
    """


@hookspec(firstresult=True)
def kvhal_current_stream(device: torch.device) -> Any:
    """The stream the engine's compute (attention, KV writes) runs on.

    Copies are ordered after it (stores read KV it writes; loads write blocks
    it may still zero), so it must be the real one.

    Promises (the conformance suite checks each one under its id):

    - ``current.compute``: the same stream on every call and, where torch
      drives streams for the device type, torch's current stream.

    On a device whose compute runs inline on the caller's thread (torch
    ``cpu`` tensors), the compute stream is an object on which submitted work
    runs at once, an event recorded completes at once (the work before it is
    done when the record is made), and a wait blocks the caller until the
    event completes: the work after the wait is the caller's own.

    Stop at first non-None result.
    """


@hookspec(firstresult=True)
def kvhal_create_event(device: torch.device) -> Any:
    """A new, unrecorded event.

    Promises (the conformance suite checks each one under its id):

    - ``event.new``: every call returns a new event, never one returned
      before; until it is recorded, querying it reports complete and
      synchronizing it returns at once.

    An event is any object; like a stream it has no destroy hook and lives as
    long as it is held.

    Stop at first non-None result.
    """


@hookspec
def kvhal_record_event(event: Any, stream: Any) -> None:
    """Record ``event`` on ``stream``: it completes when all work submitted
    to ``stream`` before this call has completed.

    Promises (the conformance suite checks each one under its id):

    - ``record.after_work``: the event does not complete before every piece
      of work submitted to ``stream`` before this call has completed,
      whatever its direction and size.
    - ``record.completes``: it does complete once that work has; recorded on
      a stream with no pending work, at once.
    - ``record.again``: recording an event again makes it follow the new
      record only: queries, synchronizes and stream waits after that call
      refer to the new record.

    An event may be recorded any number of times, on the same stream or
    another, also while its previous record is still pending.
    """


@hookspec(firstresult=True)
def kvhal_query_event(event: Any) -> bool:
    """Whether the work before ``event``'s last record has completed, without blocking.

    Promises (the conformance suite checks each one under its id):

    - ``query.state``: ``False`` while that work is incomplete, ``True`` once
      it has completed.
    - ``query.nonblocking``: it returns at once, without waiting for that work.
    - ``query.error``: it raises :class:`~kvhal.errors.TransferError` when the
      copy the event follows failed.

    A failure sticks to the record: every query and every synchronize of the
    event raises :class:`~kvhal.errors.TransferError` again, as often as
    called, until the event is recorded again.

    :raises kvhal.errors.TransferError: the copy it follows failed.
    :return: ``True`` or ``False``. Stop at first non-None result.
    """


@hookspec
def kvhal_synchronize_event(event: Any) -> None:
    """Block until ``event`` completes.

    Promises (the conformance suite checks each one under its id):

    - ``sync.waits``: it returns only once the work before the event's last
      record has completed (at once for an event never recorded).
    - ``sync.error``: it raises :class:`~kvhal.errors.TransferError` when the
      copy the event follows failed.

    It raises again on every later call, as a query does, until the event is
    recorded again.

    :raises kvhal.errors.TransferError: the copy it follows failed.
    """


@hookspec
def kvhal_stream_wait_event(stream: Any, event: Any) -> None:
    """Make work submitted to ``stream`` after this call wait for ``event``'s
    last record (without blocking the caller).

    Promises (the conformance suite checks each one under its id):

    - ``wait.orders``: work submitted to ``stream`` after this call does not
      start before the work before ``event``'s last record has completed,
      whatever its direction and size (an event never recorded holds nothing up).
    - ``wait.nonblocking``: it returns at once, without waiting for ``event``.
    - ``wait.binds``: the wait is for ``event``'s last record at the time of
      this call (as CUDA's ``cudaStreamWaitEvent``): recording ``event`` again
      afterwards, even on ``stream`` behind this wait, does not change what
      it waits for.

    "Without blocking" concerns streams from :func:`kvhal_create_stream`. On
    an inline compute stream (see :func:`kvhal_current_stream`) the work that
    follows the wait is the caller's own, so the wait blocks the caller; kvhal
    waits there for stores that still read blocks a step reuses. A wait only
    orders: the failure of the work an event follows is reported through the
    event, not through the waiting stream.
    """


# --------------------------------------------------------------------------
# Copies
# --------------------------------------------------------------------------


@hookspec(firstresult=True)
def kvhal_copy_blocks(plan: CopyPlan, stream: Any) -> Any:
    """Enqueue a checked block copy on ``stream`` and return an event recorded after it.

    ``plan`` was validated by kvhal (ids in range, unique destinations, same
    geometry and layout); it holds the ``(src, dst)`` block pairs, their runs
    of consecutive ids, and byte descriptors ``(src_ptrs, dst_ptrs, sizes)``
    with runs already coalesced.

    Promises (the conformance suite checks each one under its id; "any size"
    spans a single block of a few hundred bytes, not a multiple of any page
    or vector width, to batches of many MiB):

    - ``copy.data``: every destination block of the plan holds its source
      block's bytes, bit for bit, in either direction, at any size, in every
      dtype and K/V format the plugin declares.
    - ``copy.dst_only``: it writes only the destination blocks of
      ``plan.dst``: no other byte of ``plan.dst`` changes.
    - ``copy.src_unchanged``: it only reads ``plan.src``.
    - ``copy.ordering``: it must not start before work submitted to ``stream``
      earlier has completed, in either direction, at any size.
    - ``copy.on_stream``: it is work on ``stream``: an event recorded on
      ``stream`` after this call completes only after the copy.
    - ``copy.event``: the returned event completes only when every byte is
      written, in either direction, at any size.
    - ``copy.error``: a failure (a plan that cannot be read, an error on the
      device during the copy) does not raise from this hook; it surfaces as
      :class:`~kvhal.errors.TransferError` from querying or synchronizing the
      returned event, and later copies on ``stream`` are unaffected.
    - ``copy.async``: a plugin declaring ``copy.async`` returns without
      waiting for the copy.
    - ``copy.throughput``: copies run at the speed of the device: the
      conformance suite holds them to a fraction (0.25 by default) of a plain
      torch copy of the same bytes between the same memories.

    The descriptors' addresses are virtual addresses into ``plan.src``'s and
    ``plan.dst``'s memory (device memory on the device's side, host memory on
    the host's), valid while those caches are alive: keep a reference to
    ``plan`` in the enqueued work until it has run. Read the plan inside that
    work too, or catch what reading it raises: a copy that cannot be built
    must fail through its event, not raise here (``copy.error``). See
    :class:`~kvhal.copyplan.CopyPlan`.

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
# Test hooks: device faults and device memory (kvhal's engine never calls them)
# --------------------------------------------------------------------------

#: The faults :func:`kvhal_inject_device_fault` is asked to arm.
DEVICE_FAULTS: tuple[str, ...] = ("copy_error", "stream_stall", "event_error")


@hookspec(firstresult=True)
def kvhal_inject_device_fault(fault: str, stream: Any, seconds: float) -> bool:
    """Arm a fault inside this plugin's own device engine, for the conformance suite.

    A test hook, optional: a device plugin implements it when its probe
    declares ``test.faults`` (:attr:`~kvhal.descriptor.Capability.FAULTS`).
    The suite makes each fault happen and checks that it surfaces as the
    hooks above promise; a plugin without it gets the report row "device
    faults: not tested (no fault hook)". Each fault fires once, on
    ``stream`` (made by :func:`kvhal_create_stream`):

    - ``"copy_error"``: the next copy submitted to ``stream`` is accepted and
      its plan read, then fails on the device before all its destination
      blocks are written, as a DMA error would;
    - ``"stream_stall"``: work submitted to ``stream`` after this call starts
      only after ``seconds``, as on a stream stalled behind a hung engine;
    - ``"event_error"``: the next event recorded on ``stream`` (by
      :func:`kvhal_record_event` or a copy) reports a device error, though
      the work before it ran.

    Promises (the conformance suite checks each one under its id):

    - ``fault.inject``: returns True when it armed ``fault`` and False when
      this plugin cannot inject that one (the report then says "not tested");
      an armed fault happens: a ``copy_error`` copy leaves a destination block
      without its source's bytes, a ``stream_stall`` holds back the next copy
      for ``seconds``, an ``event_error`` makes the next event fail.

    What the plugin must do when the fault happens is the other hooks'
    promise: ``copy.error``, ``query.error`` and ``sync.error`` (the failure
    surfaces as :class:`~kvhal.errors.TransferError` from the event within a
    deadline, and later work on the stream is unaffected), ``copy.dst_only``
    (no block outside the failed copy changes), ``query.state`` and
    ``query.nonblocking`` (a stalled copy's event reads not done, at once).

    :return: whether the fault is armed. Stop at first non-None result.
    """


@hookspec(firstresult=True)
def kvhal_device_memory_in_use() -> int:
    """Bytes of device memory allocated through this plugin now, over all its devices, for
    the conformance suite: memory of live allocations (as ``torch.cuda.memory_allocated``),
    not memory a caching allocator keeps for reuse.

    A test hook, optional: the suite measures what a plugin's first probe keeps
    (``probe.no_work``) through torch's allocator where ``torch.accelerator`` sees the
    device; a plugin whose device memory it does not see (a private allocator, a runtime
    of its own) implements this so the suite can measure it. Ask the runtime (its
    allocator's statistics), never a counter of the plugin's own; answer 0 where the
    runtime was not initialized yet, without initializing it (the suite asks right before
    the plugin's first probe).

    Promises (the conformance suite checks each one under its id):

    - ``memory.report``: returns an int of at least 0; a KV cache of N bytes that
      :func:`kvhal_allocate_kv_cache` returned, while alive, raises it by at least N.

    :return: bytes in use. Stop at first non-None result.
    """


#: Hooks a device plugin implements for the conformance suite only (each optional).
TEST_HOOKS: tuple[str, ...] = ("kvhal_inject_device_fault", "kvhal_device_memory_in_use")


# --------------------------------------------------------------------------
# Pinning witnesses (not a device hook: any plugin may offer witnesses)
# --------------------------------------------------------------------------


@hookspec
def kvhal_pinning_witnesses() -> Sequence[PinningWitness]:
    """Witnesses that host memory is pinned, asked of the kernel or the device
    runtime instead of any plugin's bookkeeping.

    Not a device hook, and optional: kvhal calls it on every registered
    plugin and merges the answers (the built-in CPU plugin offers the
    ``mlock`` witness for torch device type ``cpu``, kvhal-cuda the CUDA and
    HIP runtimes' for ``cuda``). The conformance suite checks every host
    buffer a plugin declaring ``host.pinned`` says is pinned against a
    witness of the plugin's torch device type (``pinned.witness``),
    preferring one another plugin offers; with none available its report
    says "not witnessed". A witness is cheap to create and must not touch
    the device: ask the runtime only in
    :meth:`~kvhal.witness.PinningWitness.witness`.

    :return: :class:`~kvhal.witness.PinningWitness` objects, one per torch
        device type and pinning mechanism, each with a unique ``name``.
        Every plugin's result is used (not first-result).
    """


# --------------------------------------------------------------------------
# Eviction policies (not a device hook: any plugin may offer policies)
# --------------------------------------------------------------------------
# This hook and the two after it serve the layers above this one (the offloading
# core, the tiers). Their contracts live there and are named in the docstrings, not
# imported: imports point down (pyproject.toml's layers contract).


@hookspec
def kvhal_eviction_policies() -> Mapping[str, Callable[[int], Any]]:
    """Eviction policies this plugin offers to offloading managers, by name.

    Not a device hook: kvhal calls it on every registered plugin, device or
    not, and merges the answers; the built-in ``lru`` and ``s3fifo`` come
    from a built-in plugin through this same hook. An
    :class:`~kvhal.offload.manager.OffloadingManager` picks a policy by name
    (:func:`kvhal.offload.eviction.create_policy`); an unknown name is an error
    listing the known ones.

    :return: a mapping from policy name to a factory: ``factory(num_slots)``
        returns a fresh :class:`~kvhal.offload.eviction_policy.EvictionPolicy` for a manager
        of ``num_slots`` slots. A name offered by two plugins is an error
        naming both; a result that is not such a mapping, or a factory that
        returns something else, is a
        :class:`~kvhal.errors.MalformedResultError` naming the plugin. Every
        plugin's result is used (not first-result).
    """


# --------------------------------------------------------------------------
# Tier backends (not a device hook: any plugin may offer backends)
# --------------------------------------------------------------------------


@hookspec
def kvhal_tier_backends() -> Mapping[str, Callable[[Any], Any]]:
    """Tier backends this plugin offers below the host tier, by name.

    Not a device hook: kvhal calls it on every registered plugin, device or
    not, and merges the answers; the built-in ``disk`` comes from a built-in
    plugin through this same hook. A tier chain opens a backend by name
    (:func:`kvhal.tiers.media.open_tier`); an unknown name is an error listing the
    known ones.

    A backend moves bytes between host memory and its medium only: it never
    imports a device plugin or vLLM. Its contract is
    :class:`~kvhal.tiers.backend.TierBackend`: equal slots, asynchronous
    batched ``write``/``read`` returning futures, a ``read`` that delivers a
    block only once it is proven to be the requested key's under the spec's
    fingerprint (anything else is a miss: the engine recomputes), and a
    ``recover`` that lists what a restarted engine may serve.

    :return: a mapping from backend name to a factory: ``factory(spec)``
        opens a :class:`~kvhal.tiers.backend.TierBackend` for a
        :class:`~kvhal.tiers.backend.TierSpec`. It raises
        :class:`~kvhal.errors.ValidationError` naming the option at fault for
        bad options, before touching the medium. A name offered by two plugins
        is an error naming both; a result that is not such a mapping, or a
        factory that returns something else, is a
        :class:`~kvhal.errors.MalformedResultError` naming the plugin. Every
        plugin's result is used (not first-result).
    """


# --------------------------------------------------------------------------
# Remote stores (not a device hook: any plugin may offer stores)
# --------------------------------------------------------------------------


@hookspec
def kvhal_remote_stores() -> Mapping[str, Callable[[str], Any]]:
    """Shared key-value stores this plugin offers as a remote tier, by URL scheme.

    Not a device hook: kvhal calls it on every registered plugin and merges
    the answers; the built-in ``mooncake``, ``redis``, ``rediss``,
    ``redis+cluster``, ``rediss+cluster`` and ``s3`` come from a built-in plugin
    through this same hook. The connector's ``remote_url`` picks a store by
    its scheme (:func:`kvhal.tiers.media.open_store`); an unknown scheme is an
    error listing the known ones.

    A store moves bytes only; its contract is
    :class:`~kvhal.tiers.remote.store.RemoteStore` (blocking batch ``exist``,
    ``put`` and ``get``). kvhal names, frames, checksums, authenticates and
    verifies every value, and runs the calls on its own threads with
    timeouts, for every store alike.

    :return: a mapping from URL scheme to a factory: ``factory(url)``
        connects to the store the URL names. It raises
        :class:`~kvhal.errors.ValidationError` naming the part of the URL at
        fault before connecting, and
        :class:`~kvhal.tiers.remote.store.StoreUnavailable` when the store cannot
        be reached. A scheme offered by two plugins is an error naming both.
    """
