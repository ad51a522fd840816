"""A worker's memory for kvhal: the engine's KV cache wrapped per KV cache group, and the host
tier's pinned buffer laid out with the same geometry."""

from __future__ import annotations

from typing import Any

from kvhal.cache import KVCache
from kvhal.device import Device
from kvhal.errors import ValidationError
from kvhal.layouts import layout_by_name
from kvhal.offload.host_tier import HostTier
from kvhal.registry import select_device
from kvhal.vllm.cache_shapes import group_views
from kvhal.vllm.config import ConnectorConfig


def wrap_caches(
    config: ConnectorConfig, kv_caches: dict[str, Any], device: Device | None = None
) -> tuple[Device, dict[int, KVCache], HostTier, dict[int, KVCache]]:
    """The device plugin for the KV cache's device (or ``device``, bound already), each
    group's cache, the host tier, and each group's view of the host tier.

    :raises ValidationError: a layer is missing or of a shape kvhal refuses, or its blocks
        do not hold the bytes vLLM's KV cache spec says (naming the layer); a copy the
        device cannot make (naming the plugin).
    """
    views = group_views(kv_caches, config.groups)
    first = next(iter(views.values())).layers[0][0]
    if device is None:
        device = select_device(config.device, device_type=first.device.type)
    layout = layout_by_name(config.layout)
    caches: dict[int, KVCache] = {}
    for group in config.groups:
        tensors = views[group.group_id]
        cache = KVCache.wrap(tensors.layers, layout, head_size=tensors.head_size)
        if cache.geometry.block_bytes != group.slot_bytes:
            raise ValidationError(
                "kv_caches",
                f"KV cache group {group.group_id} (layers {group.layer_names[0]!r}...): a block of "
                f"its tensors holds {cache.geometry.block_bytes} bytes, vLLM's KV cache spec says "
                f"{group.slot_bytes} ({len(group.layer_names)} layers x {group.page_bytes})",
            )
        caches[group.group_id] = cache
    host_tier = HostTier(device, config.num_slots * config.slot_bytes, config.slot_bytes)
    host_views: dict[int, KVCache] = {}
    for group_id, cache in caches.items():
        host = host_views[group_id] = host_tier.view(cache.geometry, layout)
        # a copy the device cannot make (a split cache on a plugin without kv.split,
        # say) fails engine start, naming the plugin, rather than every job later
        device.plan_copy(cache, host, [(0, 0)])
    return device, caches, host_tier, host_views
