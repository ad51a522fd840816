"""The contracts the suite checks: one test module each, in report order."""

from __future__ import annotations

from dataclasses import dataclass

from kvhal.hookspecs import DEVICE_HOOKS


@dataclass(frozen=True)
class Contract:
    """One hook contract and the test module that checks it.

    :param id: the module's name without ``test_``; the report's key.
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
        "present device with known capabilities",
    ),
    Contract(
        "layouts",
        "Layouts",
        ("kvhal_kv_layouts", "kvhal_allocate_kv_cache"),
        "layouts are non-empty sequences of KVLayout whose stride orders are permutations; views "
        "have the shapes and strides their layout promises; cross-layer blocks are contiguous",
    ),
    Contract(
        "allocation",
        "Allocation",
        ("kvhal_allocate_kv_cache",),
        "caches come back with the asked geometry, dtype, layout and device, zeroed, every "
        "element its own memory; what the device cannot hold is refused with ValidationError",
    ),
    Contract(
        "host_memory",
        "Host memory",
        ("kvhal_allocate_host_buffer", "kvhal_host_buffer_is_pinned", "kvhal_free_host_buffer"),
        "host buffers are flat, zeroed (also when memory is reused), 4 KiB-aligned CPU byte "
        "tensors of at least the size asked for, independent of each other, and pinned (or "
        "registered) when the plugin declares host.pinned; a plain tensor is not reported pinned",
    ),
    Contract(
        "streams_events",
        "Streams and events",
        (*(hook for hook in DEVICE_HOOKS if hook.endswith(("_stream", "_event"))), "kvhal_copy_blocks"),
        "the current stream is the compute stream (the same on every call, torch's where torch "
        "drives the device); an event is not complete before its work and is complete after; "
        "work on one stream stays ordered; a stream waits for another's event; copies run on "
        "the stream given (and asynchronously when copy.async is declared)",
    ),
    Contract(
        "copies",
        "Copies",
        ("kvhal_copy_blocks",),
        "random and edge-case block mappings, both directions, layer-separate and cross-layer "
        "layouts, bf16/fp16/fp32/fp8, stacked and split K/V: every mapped block arrives intact, "
        "no other block is written, the source is unchanged",
    ),
    Contract(
        "bad_input",
        "Bad input",
        ("kvhal_copy_blocks", "kvhal_allocate_kv_cache", "kvhal_allocate_host_buffer"),
        "invalid copies, allocations and buffer sizes raise kvhal's error types and move no byte",
    ),
    Contract(
        "throughput",
        "Throughput",
        ("kvhal_copy_blocks",),
        "device->host and host->device block copies reach at least the floor times a plain "
        "torch copy of the same bytes measured in the same run",
    ),
)

BY_ID = {c.id: c for c in CONTRACTS}


def contract_of_module(module_name: str) -> Contract | None:
    """The contract a suite module (``kvhal_conformance.test_copies``) checks, if any."""
    prefix = __package__ + ".test_"
    if not module_name.startswith(prefix):
        return None
    return BY_ID.get(module_name[len(prefix) :])
