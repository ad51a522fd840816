"""kvhal's facade calls the checks need for setting up, with failures named by clause.

A check of copies needs caches and host buffers; when the plugin's allocation
breaks its own promise (a result kvhal refuses, an exception), that is the
allocation clause's failure, not the copy's. These wrappers fail the calling
check (or fixture) with the clause named, so the report blames the right promise.
"""

from __future__ import annotations

import torch

from kvhal.cache import KVCache
from kvhal.device import Device
from kvhal.errors import MalformedResultError, PluginError
from kvhal.geometry import KVGeometry
from kvhal.layouts import KVLayout
from kvhal_conformance.clauses import violated


def kv_cache(device: Device, geometry: KVGeometry, layout: KVLayout | None = None) -> KVCache:
    """``device.allocate_kv_cache``; a refused result or an exception is ``alloc.as_asked``."""
    try:
        return device.allocate_kv_cache(geometry, layout)
    except PluginError as exc:
        violated("alloc.as_asked", f"allocating a KV cache for a check failed: {exc}")


def host_buffer(device: Device, nbytes: int) -> torch.Tensor:
    """``device.allocate_host_buffer``; a misaligned result is ``host.aligned``, any other
    refused result or an exception ``host.buffer``."""
    try:
        return device.allocate_host_buffer(nbytes)
    except MalformedResultError as exc:
        clause = "host.aligned" if "aligned" in str(exc) else "host.buffer"
        violated(clause, f"allocating a {nbytes}-byte host buffer for a check failed: {exc}")
    except PluginError as exc:
        violated("host.buffer", f"allocating a {nbytes}-byte host buffer for a check failed: {exc}")


def host_cache(device: Device, geometry: KVGeometry, layout: KVLayout, num_blocks: int) -> KVCache:
    """``device.allocate_host_cache`` with :func:`host_buffer`'s clauses."""
    try:
        return device.allocate_host_cache(geometry, layout, num_blocks)
    except MalformedResultError as exc:
        clause = "host.aligned" if "aligned" in str(exc) else "host.buffer"
        violated(clause, f"allocating a host cache for a check failed: {exc}")
    except PluginError as exc:
        violated("host.buffer", f"allocating a host cache for a check failed: {exc}")


def free_buffer(device: Device, buffer: torch.Tensor) -> None:
    """``device.free_host_buffer``; an exception is ``free.release``."""
    try:
        device.free_host_buffer(buffer)
    except PluginError as exc:
        violated("free.release", f"freeing a {buffer.numel()}-byte host buffer failed: {exc}")


def free_cache(device: Device, cache: KVCache) -> None:
    for buffer in cache.storage:
        free_buffer(device, buffer)


def is_pinned(device: Device, buffer: torch.Tensor) -> bool:
    """``device.host_buffer_is_pinned``; a result that is no bool, or an exception, is ``pinned.bool``."""
    try:
        return device.host_buffer_is_pinned(buffer)
    except PluginError as exc:
        violated("pinned.bool", str(exc))
