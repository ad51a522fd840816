"""kvhal: KV-cache offloading on any accelerator, through device plugins.

The modules at the top of this package are the HAL core, what device plugins use (the
hookspecs, the registry, the device facade, layouts, caches, copy plans, ``accel``, the
CPU plugin); its public names are exported here. The layers above it are packages:
:mod:`kvhal.offload` (host memory), :mod:`kvhal.tiers` (below it), :mod:`kvhal.vllm` (the
adapter), and :mod:`kvhal.bench` with the CLI on top (docs/architecture.md).
"""

from kvhal.blocks import get_kv_from_block, put_kv_into_block
from kvhal.cache import KVCache, allocate_dense_kv_cache, dense_kv_cache, dense_nbytes
from kvhal.copyplan import CopyPlan, Direction, plan_copy
from kvhal.descriptor import Capability, DeviceDescriptor, Refusal
from kvhal.device import Device
from kvhal.errors import (
    BlockStateError,
    ClosedError,
    CopyValidationError,
    DeviceSelectionError,
    KVHALError,
    LayoutError,
    MalformedResultError,
    MissingHookError,
    PluginError,
    PluginLoadError,
    PluginValidationError,
    PolicyError,
    TierError,
    TransferError,
    ValidationError,
)
from kvhal.geometry import KVFormat, KVGeometry
from kvhal.hookspecs import hookimpl
from kvhal.layouts import STANDARD_LAYOUTS, KVLayout, layout_by_name
from kvhal.registry import PluginRegistry, select_device

__version__ = "0.1.0"

__all__ = [
    "STANDARD_LAYOUTS",
    "BlockStateError",
    "Capability",
    "ClosedError",
    "CopyPlan",
    "CopyValidationError",
    "Device",
    "DeviceDescriptor",
    "DeviceSelectionError",
    "Direction",
    "KVCache",
    "KVFormat",
    "KVGeometry",
    "KVHALError",
    "KVLayout",
    "LayoutError",
    "MalformedResultError",
    "MissingHookError",
    "PluginError",
    "PluginLoadError",
    "PluginRegistry",
    "PluginValidationError",
    "PolicyError",
    "Refusal",
    "TierError",
    "TransferError",
    "ValidationError",
    "allocate_dense_kv_cache",
    "dense_kv_cache",
    "dense_nbytes",
    "get_kv_from_block",
    "hookimpl",
    "layout_by_name",
    "plan_copy",
    "put_kv_into_block",
    "select_device",
]
