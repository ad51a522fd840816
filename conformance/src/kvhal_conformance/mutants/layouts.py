"""Mutants of the layout hooks."""

from __future__ import annotations

from collections.abc import Sequence

from kvhal.cpu import CPUPlugin
from kvhal.descriptor import Capability, DeviceDescriptor, Refusal
from kvhal.hookspecs import hookimpl
from kvhal.layouts import KVLayout
from kvhal_conformance.mutants.registry import (
    _replace_caps,
    mutant,
)


@mutant("layouts.sequence")
class NoLayoutsForGPUBackends(CPUPlugin):
    """Answers None for attention backend names it does not know (only for None and CPU names)."""

    @hookimpl
    def kvhal_kv_layouts(self, attention_backend: str | None) -> Sequence[KVLayout] | None:
        if attention_backend is not None and not attention_backend.upper().startswith(("CPU", "TORCH")):
            return None
        return super().kvhal_kv_layouts(attention_backend)


class _Tiled(KVLayout):
    """A hand-made layout that skips KVLayout's own validation."""

    def __post_init__(self) -> None:
        pass


@mutant("layouts.permutation")
class RepeatedDimForFlashInfer(CPUPlugin):
    """For FLASHINFER, adds a tiled layout whose stride order repeats N (a 5-tuple, but no C)."""

    @hookimpl
    def kvhal_kv_layouts(self, attention_backend: str | None) -> Sequence[KVLayout]:
        layouts = tuple(super().kvhal_kv_layouts(attention_backend))
        if attention_backend == "FLASHINFER":
            return (*layouts, _Tiled("LBHN-tiled", (0, 1, 2, 3, 3)))
        return layouts


@mutant("layouts.cross_layer")
class UndeclaredCrossLayer(CPUPlugin):
    """Offers cross-layer layouts but forgets to declare ``layout.cross_layer``."""

    @hookimpl
    def kvhal_probe(self) -> DeviceDescriptor | Refusal:
        return _replace_caps(super().kvhal_probe(), drop={Capability.CROSS_LAYER.value})
