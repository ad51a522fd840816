"""The device facade refuses a layout whose stride order is not a permutation, naming the plugin."""

from __future__ import annotations

import pytest

from kvhal.errors import MalformedResultError
from kvhal.registry import PluginRegistry

broken_plugins = pytest.importorskip("broken_plugins")


def test_non_permutation_stride_order_is_refused() -> None:
    registry = PluginRegistry(autoload=False, allow=None, block=())
    registry.register(broken_plugins.StrideOrderNotPermutation(), "tiled", "tests")
    device = registry.select("tiled")
    with pytest.raises(MalformedResultError, match="not a permutation") as raised:
        device.kv_layouts()
    assert raised.value.plugin == "tiled" and raised.value.hook == "kvhal_kv_layouts"
    assert "(0, 1, 2, 3, 3)" in str(raised.value)
