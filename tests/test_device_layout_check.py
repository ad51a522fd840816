"""The device facade refuses a layout whose stride order is not a permutation, naming the plugin."""

from __future__ import annotations

import pytest

from kvhal.errors import MalformedResultError, PluginError, ValidationError
from kvhal.registry import PluginRegistry
from tests import broken_plugins


def test_non_permutation_stride_order_is_refused() -> None:
    registry = PluginRegistry(autoload=False, allow=None, block=())
    registry.register(broken_plugins.StrideOrderNotPermutation(), "tiled", "tests")
    device = registry.select("tiled")
    with pytest.raises(MalformedResultError, match="not a permutation") as raised:
        device.kv_layouts()
    assert raised.value.plugin == "tiled" and raised.value.hook == "kvhal_kv_layouts"
    assert "(0, 1, 2, 3, 3)" in str(raised.value)


class _RefusesHostSize(broken_plugins.CPUPlugin):
    """A plugin whose own argument check fires (as a real vendor check would)."""

    @broken_plugins.hookimpl
    def kvhal_allocate_host_buffer(self, nbytes: int) -> object:
        raise ValidationError("nbytes", "over this device's registration limit")


def test_a_plugin_refusing_an_argument_is_both_a_validation_and_a_plugin_error() -> None:
    registry = PluginRegistry(autoload=False, allow=None, block=())
    registry.register(_RefusesHostSize(), "picky", "tests")
    device = registry.select("picky")
    with pytest.raises(ValidationError) as raised:
        device.allocate_host_buffer(1 << 20)
    assert isinstance(raised.value, PluginError)
    assert (raised.value.plugin, raised.value.hook, raised.value.argument) == (
        "picky",
        "kvhal_allocate_host_buffer",
        "nbytes",
    )
    where = "plugin 'picky' (distribution tests), hook kvhal_allocate_host_buffer"
    assert str(raised.value) == f"{where}: nbytes: over this device's registration limit"
