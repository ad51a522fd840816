"""What the tests are parametrized over: layouts, dtypes, K/V formats, small geometries."""

from __future__ import annotations

import pytest
import torch

from kvhal.descriptor import Capability, dtype_capability
from kvhal.device import REQUIRED_DTYPES, Device
from kvhal.geometry import KVFormat, KVGeometry
from kvhal.layouts import KVLayout
from kvhal_conformance.target import Target

LAYER_SEPARATE, CROSS_LAYER = "layer-separate", "cross-layer"
LAYOUT_KINDS = (LAYER_SEPARATE, CROSS_LAYER)
DTYPES = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
    "fp8": torch.float8_e4m3fn,
}
FORMATS = {"stacked": KVFormat.STACKED, "split": KVFormat.SPLIT}


def require_dtype(target: Target, dtype: torch.dtype) -> None:
    """Skip unless ``dtype`` is one every plugin copies or one the plugin declares."""
    if dtype not in REQUIRED_DTYPES:
        target.require(dtype_capability(dtype))


def require_format(target: Target, kv_format: KVFormat) -> None:
    if kv_format is KVFormat.SPLIT:
        target.require(Capability.SPLIT_KV)


def require_layout(target: Target, layout: KVLayout) -> None:
    if layout.is_cross_layer:
        target.require(Capability.CROSS_LAYER)


def layout_of_kind(target: Target, device: Device, kind: str) -> KVLayout:
    """The plugin's preferred layer-separate or cross-layer layout (skipping, with the
    capability named, when cross-layer is not declared)."""
    layouts = device.kv_layouts()
    if kind == CROSS_LAYER:
        target.require(Capability.CROSS_LAYER)
        found = [layout for layout in layouts if layout.is_cross_layer]
        if not found:
            pytest.fail(
                f"plugin {target.name!r} declares {Capability.CROSS_LAYER.value} but "
                f"kvhal_kv_layouts(None) offers no cross-layer layout: {[str(x) for x in layouts]}"
            )
        return found[0]
    found = [layout for layout in layouts if not layout.is_cross_layer]
    if not found:
        pytest.skip(f"kvhal_kv_layouts(None) of plugin {target.name!r} offers no layer-separate layout")
    return found[0]


def small_geometry(
    dtype: torch.dtype = torch.bfloat16,
    kv_format: KVFormat = KVFormat.STACKED,
    num_blocks: int = 40,
    num_layers: int = 3,
) -> KVGeometry:
    """A few hundred bytes per block and layer: enough to see every byte land."""
    return KVGeometry(
        num_layers=num_layers,
        num_blocks=num_blocks,
        block_size=4,
        num_kv_heads=2,
        head_size=8,
        dtype=dtype,
        kv_format=kv_format,
    )


def describe(layout: KVLayout, geometry: KVGeometry) -> str:
    """``layout BLHNC, bfloat16, stacked`` for messages."""
    return f"layout {layout}, {str(geometry.dtype).removeprefix('torch.')}, {geometry.kv_format.value}"


def distinct_geometry(
    kv_format: KVFormat = KVFormat.STACKED, dtype: torch.dtype = torch.bfloat16
) -> KVGeometry:
    """Every logical dim a different size (L=3, B=7, H=2, N=5, C=8 or 4 per part), so a
    swapped dim cannot hide."""
    return KVGeometry(
        num_layers=3,
        num_blocks=7,
        block_size=5,
        num_kv_heads=2,
        head_size=4,
        dtype=dtype,
        kv_format=kv_format,
    )


def offered_layouts(target: Target, device: Device) -> list[KVLayout]:
    """The layouts ``kvhal_kv_layouts(None)`` offers that the plugin's capabilities allow."""
    return [
        layout
        for layout in device.kv_layouts()
        if not layout.is_cross_layer or target.declares(Capability.CROSS_LAYER)
    ]
