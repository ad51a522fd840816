"""kvhal-rocm as kvhal loads it; its KV buffers are padded to whole pages like vLLM's on ROCm."""

from __future__ import annotations

import torch

from kvhal.cache import dense_nbytes
from kvhal.geometry import KVFormat, KVGeometry
from kvhal.layouts import LBHNC
from kvhal.registry import PluginRegistry
from kvhal_rocm.plugin import KV_BUFFER_ROUNDING, ROCmPlugin


def test_the_entry_point_loads_and_declines_here():
    registry = PluginRegistry(allow=None, block=())
    info = next(p for p in registry.plugins if p.name == "rocm")
    assert isinstance(info.plugin, ROCmPlugin) and info.distribution.startswith("kvhal-rocm")
    if not getattr(torch.version, "hip", None):
        reason = registry.probe(info).reason
        assert ("CUDA build" if torch.version.cuda else "built without HIP") in reason


def test_kv_buffers_are_rounded_up_to_4096_bytes():
    g = KVGeometry(3, 7, 16, 1, 40, torch.float16, kv_format=KVFormat.SPLIT)
    cache = ROCmPlugin().kvhal_allocate_kv_cache(g, LBHNC, torch.device("cpu"))
    (buffer,) = cache.storage
    assert dense_nbytes(g) % KV_BUFFER_ROUNDING != 0
    assert buffer.numel() % KV_BUFFER_ROUNDING == 0 and 0 <= buffer.numel() - dense_nbytes(g) < 4096
    assert cache.geometry == g and int(buffer.abs().sum()) == 0
