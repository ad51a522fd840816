"""The contracts the suite checks, in report order: one base class each in
:mod:`kvhal_conformance.base`, bound to the command line by the suite's module ``test_<id>.py``."""

from __future__ import annotations

from dataclasses import dataclass

from kvhal.hookspecs import DEVICE_HOOKS


@dataclass(frozen=True)
class Contract:
    """One hook contract.

    :param id: the report's key; its base class's ``contract_id`` and the suite's module
        ``test_<id>.py``.
    :param title: a heading for the report.
    :param hooks: the hooks it exercises.
    :param checks: what it checks, in one sentence for the report and README.
    """

    id: str
    title: str
    hooks: tuple[str, ...]
    checks: str


CONTRACTS: tuple[Contract, ...] = (
    Contract(
        "probe",
        "Probe",
        ("kvhal_probe",),
        "every required hook is implemented; the probe returns a well-formed descriptor of a "
        "present device with known capabilities, every time, and starts no threads or device memory",
    ),
    Contract(
        "layouts",
        "Layouts",
        ("kvhal_kv_layouts", "kvhal_allocate_kv_cache"),
        "layouts are non-empty sequences of KVLayout whose stride orders are permutations, for the "
        "default and vLLM backend names; cross-layer ones exactly when declared; views have the shapes "
        "and strides their layout promises; cross-layer blocks are contiguous",
    ),
    Contract(
        "allocation",
        "Allocation",
        ("kvhal_allocate_kv_cache",),
        "caches come back with the asked geometry, dtype (every declared dtype.*), layout and device, "
        "zeroed (also at many MiB, also reusing memory), every element its own memory; what the "
        "device cannot hold is refused with ValidationError",
    ),
    Contract(
        "host_memory",
        "Host memory",
        ("kvhal_allocate_host_buffer", "kvhal_host_buffer_is_pinned", "kvhal_free_host_buffer"),
        "host buffers of any size (one byte, odd sizes, a host tier) are flat, zeroed (also when "
        "memory is reused), 4 KiB-aligned CPU byte tensors of at least the size asked for, "
        "independent of each other while alive, freed without error, and pinned (or registered) when "
        "the plugin declares host.pinned; a plain tensor is not reported pinned",
    ),
    Contract(
        "streams_events",
        "Streams and events",
        (*(hook for hook in DEVICE_HOOKS if hook.endswith(("_stream", "_event"))), "kvhal_copy_blocks"),
        "the current stream is the compute stream; new streams and events are new; in both "
        "directions, for one small block, one odd-sized block and many MiB, on one stream and across "
        "two joined by a wait, a copy writes nothing before earlier work completes and its events "
        "complete only after its bytes are written; re-recorded events follow their new record; "
        "query, stream waits and (with copy.async) copies do not block; a failed copy surfaces as "
        "TransferError from its event",
    ),
    Contract(
        "copies",
        "Copies",
        ("kvhal_copy_blocks",),
        "random and edge-case block mappings, both directions, layer-separate and cross-layer "
        "layouts, every required and declared dtype, stacked and split K/V, one small block, one "
        "odd-sized block and many MiB: every mapped block arrives intact, no other byte is written, "
        "the source is unchanged",
    ),
    Contract(
        "bad_input",
        "Bad input",
        ("kvhal_copy_blocks", "kvhal_allocate_kv_cache", "kvhal_allocate_host_buffer"),
        "invalid copies, allocations and buffer sizes raise kvhal's error types and move no byte",
    ),
    Contract(
        "device_faults",
        "Device faults",
        ("kvhal_inject_device_fault", "kvhal_copy_blocks", "kvhal_query_event", "kvhal_synchronize_event"),
        "with test.faults declared, faults the plugin arms in its own engine (a copy failed on the device, "
        "a stalled stream, a failed event) surface as TransferError from the event within a deadline, "
        "touch no block outside the copy, read not done while stalled, and leave the stream working; "
        "without it the report says not tested",
    ),
    Contract(
        "throughput",
        "Throughput",
        ("kvhal_copy_blocks",),
        "device->host and host->device block copies reach at least the floor times a plain torch copy "
        "of the same bytes measured in the same run; with host.pinned declared, a host buffer never "
        "pinned fails, naming host.pinned, instead of being measured",
    ),
    Contract(
        "worker_path",
        "Worker path",
        (
            "kvhal_allocate_host_buffer",
            "kvhal_create_stream",
            "kvhal_current_stream",
            "kvhal_copy_blocks",
            "kvhal_record_event",
            "kvhal_query_event",
            "kvhal_stream_wait_event",
        ),
        "each kept trace of a vLLM worker's connector calls (kvhal_conformance.traces, and any given "
        "with --trace) replayed on the device (kvhal replay): every loaded block byte for byte as "
        "stored, every store whole, every job ending as recorded; a trace needing what the device "
        "or the replay lacks (a store it cannot reach, a geometry it cannot allocate) reads not tested",
    ),
)

BY_ID = {c.id: c for c in CONTRACTS}


def contract_of_module(module_name: str) -> Contract | None:
    """The contract a suite module (``kvhal_conformance.test_copies``) checks, if any."""
    prefix = __package__ + ".test_"
    if not module_name.startswith(prefix):
        return None
    return BY_ID.get(module_name[len(prefix) :])
