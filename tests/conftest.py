"""Shared fixtures: a registry and device bound to the built-in CPU plugin alone."""

from __future__ import annotations

import pytest

from kvhal.registry import PluginRegistry


@pytest.fixture
def registry() -> PluginRegistry:
    """A registry with only the built-in CPU plugin (entry points not loaded)."""
    return PluginRegistry(autoload=False, allow=None, block=())


@pytest.fixture
def cpu(registry):
    return registry.select("cpu")
