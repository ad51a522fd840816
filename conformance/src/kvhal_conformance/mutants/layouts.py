"""Mutants of the layout hooks."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvhal.cache import KVCache
from kvhal.cpu import CPUPlugin
from kvhal.descriptor import Capability, DeviceDescriptor, Refusal
from kvhal.errors import ValidationError
from kvhal.geometry import KVGeometry
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


#: A layer-separate layout no standard answer holds (heads outside blocks and tokens).
_LHNBC = KVLayout.from_name("LHNBC")


@mutant("layouts.backend")
class BackendAnswersUnoffered(CPUPlugin):
    """Declares its own attention backend ``MUTANT_ATTN`` (``ATTENTION_BACKENDS``) and answers it a
    layout (LHNBC, which it allocates) its default answer lacks, so kvhal never allocates it."""

    ATTENTION_BACKENDS = ("MUTANT_ATTN",)

    @hookimpl
    def kvhal_kv_layouts(self, attention_backend: str | None) -> Sequence[KVLayout]:
        if attention_backend == "MUTANT_ATTN":
            return (_LHNBC,)
        return super().kvhal_kv_layouts(attention_backend)


@mutant("layouts.backend")
class BackendAnswersUnallocatable(CPUPlugin):
    """Answers FLASH_ATTN a layout (LHNBC) the device cannot allocate: its allocation raises
    ValidationError for it (the default answer lacks it too)."""

    @hookimpl
    def kvhal_kv_layouts(self, attention_backend: str | None) -> Sequence[KVLayout]:
        if attention_backend == "FLASH_ATTN":
            return (_LHNBC, *super().kvhal_kv_layouts(attention_backend))
        return super().kvhal_kv_layouts(attention_backend)

    @hookimpl
    def kvhal_allocate_kv_cache(
        self, geometry: KVGeometry, layout: KVLayout, device: torch.device
    ) -> KVCache:
        if layout.stride_order == _LHNBC.stride_order:
            raise ValidationError("layout", f"{layout} is not a layout this device allocates")
        return super().kvhal_allocate_kv_cache(geometry, layout, device)
