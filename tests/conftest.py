"""Shared fixtures: a registry and device bound to the built-in CPU plugin alone; hypothesis's
profiles (``KVHAL_HYPOTHESIS=quick`` runs each property with a tenth of its examples: the inner
loop, ``bash scripts/test.sh --quick``; CI and the full run use ``full``)."""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

from kvhal.registry import PluginRegistry

# Loaded here, before any test module is imported: tests.helpers.examples() reads it when
# the modules' @settings decorators run.
settings.register_profile("full", max_examples=100)
settings.register_profile("quick", max_examples=10)
settings.load_profile(os.environ.get("KVHAL_HYPOTHESIS", "full"))


@pytest.fixture
def registry() -> PluginRegistry:
    """A registry with only the built-in CPU plugin (entry points not loaded)."""
    return PluginRegistry(autoload=False, allow=None, block=())


@pytest.fixture
def cpu(registry):
    return registry.select("cpu")
