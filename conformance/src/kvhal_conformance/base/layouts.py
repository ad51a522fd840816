"""Contract: KV layouts (``kvhal_kv_layouts``) and the views allocation lays out in them."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest
import torch

from kvhal.cache import KVCache
from kvhal.descriptor import Capability
from kvhal.device import Device
from kvhal.errors import MalformedResultError
from kvhal.layouts import LOGICAL_DIMS, KVLayout
from kvhal_conformance import guarded
from kvhal_conformance.base.fixtures import ContractFixtures, final
from kvhal_conformance.cases import (
    FORMATS,
    describe,
    distinct_geometry,
    offered_layouts,
    require_dtype,
    require_format,
    small_geometry,
)
from kvhal_conformance.clauses import covers, expect, violated
from kvhal_conformance.target import Target

#: None asks for the device's default kernels; the names are vLLM attention backends.
BACKENDS = (None, "FLASH_ATTN", "TRITON_ATTN", "FLASHINFER", "ROCM_ATTN", "CPU_ATTN")
PERMUTATION = tuple(range(len(LOGICAL_DIMS)))


def _stride_problems(cache: KVCache, layout: KVLayout) -> list[str]:
    """Whether each part's 5-d strides ([L] from layer spacing, [B, H, N, C] from the
    views) nest in the layout's order, outermost first, innermost dense."""
    g, problems = cache.geometry, []
    for part in range(g.num_parts):
        views = [layer[part] for layer in cache.layers]
        where = f"layout {layout}" + (f", part {'KV'[part]}" if g.num_parts == 2 else "")
        for layer, view in enumerate(views):
            if tuple(view.shape) != g.layer_shape(part):
                problems.append(
                    f"{where}: layer {layer} has shape {tuple(view.shape)}, expected [B, "
                    f"H, N, C] = {g.layer_shape(part)}"
                )
            if view.stride() != views[0].stride():
                problems.append(
                    f"{where}: layer {layer} has strides {view.stride()}, layer 0 {views[0].stride()}"
                )
        gaps = {b.data_ptr() - a.data_ptr() for a, b in itertools.pairwise(views)}
        if len(gaps) != 1:
            problems.append(f"{where}: layers are not evenly spaced in one buffer (byte gaps {sorted(gaps)})")
            continue
        strides = (gaps.pop() // views[0].element_size(), *views[0].stride())
        sizes = (g.num_layers, *g.layer_shape(part))
        order = layout.stride_order
        if strides[order[-1]] != 1:
            problems.append(
                f"{where}: innermost dim {LOGICAL_DIMS[order[-1]]} has stride "
                f"{strides[order[-1]]}, expected 1"
            )
        for outer, inner in itertools.pairwise(order):
            if strides[outer] < strides[inner] * sizes[inner]:
                problems.append(
                    f"{where}: dim {LOGICAL_DIMS[outer]} (stride {strides[outer]}) is not outside dim "
                    f"{LOGICAL_DIMS[inner]} (stride {strides[inner]} x size {sizes[inner]}); strides "
                    f"{dict(zip(LOGICAL_DIMS, strides, strict=True))}"
                )
    return problems


def _contiguity_problems(cache: KVCache, layout: KVLayout) -> list[str]:
    """In a cross-layer layout, one block of every layer is one contiguous byte region (per
    part): its elements, all distinct, span exactly their own size."""
    g, problems = cache.geometry, []
    for part in range(g.num_parts):
        for block in sorted({0, 1, g.num_blocks - 1}):
            pieces = [views[part][block] for views in cache.layers]
            itemsize = pieces[0].element_size()
            start = min(p.data_ptr() for p in pieces)
            end = max(
                p.data_ptr()
                + sum((n - 1) * s for n, s in zip(p.shape, p.stride(), strict=True)) * itemsize
                + itemsize
                for p in pieces
            )
            size = g.num_layers * g.page_bytes(part)
            if end - start != size:
                where = f" (part {'KV'[part]})" if g.num_parts == 2 else ""
                problems.append(
                    f"layout {layout} is cross-layer but block {block}{where} of all "
                    f"layers spans {end - start} bytes for its {size}: one block of every "
                    "layer must be one contiguous region"
                )
    return problems


class LayoutsContract(ContractFixtures):
    """Contract ``layouts``: ``kvhal_kv_layouts`` returns non-empty sequences of layouts whose
    stride orders are permutations, cross-layer ones exactly when declared; caches are laid out
    as their layout says, cross-layer blocks contiguous.

    Fixtures: ``kvhal_target``, ``kvhal_device``, ``kvhal_backends`` (see :class:`ContractFixtures`).

    Hooks: :attr:`attention_backends`. The plugin's own backend names come from its optional
    ``ATTENTION_BACKENDS`` attribute and ``kvhal_backends``; ``test_backend_layouts_are_offered``
    asks about every one of them.
    """

    contract_id = "layouts"
    #: The attention backend names ``kvhal_kv_layouts`` is asked about (None: the device's
    #: default kernels). Add the names of your own kernels:
    #: ``attention_backends = (*LayoutsContract.attention_backends, "MY_ATTN")``.
    attention_backends: tuple[str | None, ...] = BACKENDS

    def backends_to_check(self, config: pytest.Config) -> Sequence[str | None]:
        return self.attention_backends

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        super().pytest_generate_tests(metafunc)
        if "backend" in metafunc.fixturenames:
            names = self.backends_to_check(metafunc.config)
            metafunc.parametrize("backend", names, ids=lambda b: b or "default")

    @final
    @covers("layouts.sequence", "layouts.permutation")
    def test_layouts_are_permutations(
        self, kvhal_target: Target, kvhal_device: Device, backend: str | None
    ) -> None:
        """kvhal_kv_layouts returns a non-empty sequence of KVLayout, each stride order a
        permutation of [L, B, H, N, C]."""
        hook, label = "kvhal_kv_layouts", kvhal_target.label
        try:
            result = kvhal_target.caller(hook)(attention_backend=backend)
        except Exception as exc:  # LayoutError too
            violated(
                "layouts.sequence",
                f"{label} hook {hook}(attention_backend={backend!r}) raised {type(exc).__name__}: {exc}",
            )
        if isinstance(result, (str, bytes)) or not isinstance(result, Sequence) or not result:
            violated(
                "layouts.sequence",
                f"{label} hook {hook}(attention_backend={backend!r}) returned "
                f"{result!r}; expected a non-empty sequence",
            )
        for layout in result:
            expect(
                isinstance(layout, KVLayout),
                "layouts.sequence",
                f"{label} hook {hook}(attention_backend={backend!r}) returned {layout!r} "
                f"({type(layout).__name__}); expected KVLayout",
            )
            order = tuple(layout.stride_order)
            expect(
                sorted(order) == list(PERMUTATION),
                "layouts.permutation",
                f"{label} hook {hook} returned a stride order that is not a permutation: layout "
                f"{layout.name!r} has stride order {order}; expected a permutation of {PERMUTATION} over [L, "
                f"B, H, N, C] (attention_backend={backend!r})",
            )
            if sorted(layout.name) == sorted(LOGICAL_DIMS):
                expect(
                    layout.name == layout.letters,
                    "layouts.permutation",
                    f"{label} hook {hook} returned layout {layout.name!r} whose stride order "
                    f"{order} spells {layout.letters}",
                )
        kvhal_device.kv_layouts(backend)  # and kvhal's own checks accept it

    @final
    @covers("layouts.cross_layer")
    def test_cross_layer_offered_iff_declared(self, kvhal_target: Target, kvhal_device: Device) -> None:
        """Cross-layer layouts are offered exactly when layout.cross_layer is declared."""
        capability = Capability.CROSS_LAYER.value
        for backend in self.attention_backends:
            try:
                layouts = kvhal_device.kv_layouts(backend)
            except (
                MalformedResultError
            ):  # not a sequence of valid layouts: test_layouts_are_permutations says why
                continue
            cross = [str(layout) for layout in layouts if layout.is_cross_layer]
            if kvhal_target.declares(capability):
                expect(
                    cross or backend is not None,
                    "layouts.cross_layer",
                    f"plugin {kvhal_target.name!r} declares {capability} but "
                    "kvhal_kv_layouts(None) offers no cross-layer layout",
                )
            else:
                expect(
                    not cross,
                    "layouts.cross_layer",
                    f"kvhal_kv_layouts({backend!r}) of plugin {kvhal_target.name!r} offers "
                    f"cross-layer layouts {cross} but the plugin does not declare {capability}, so "
                    "kvhal refuses to allocate them",
                )

    @final
    @covers("alloc.layout", "alloc.cross_layer")
    @pytest.mark.parametrize("fmt", FORMATS)
    def test_views_follow_layout(
        self, kvhal_target: Target, kvhal_device: Device, dtype: torch.dtype, fmt: str
    ) -> None:
        """For every offered layout and every required and declared dtype, views have the
        [B, H, N, C] shapes and the stride order the layout promises; cross-layer blocks are
        contiguous. Per dtype: a cache laid out right in bf16 may not be in fp16 or fp8, and the
        copies are judged through these views."""
        kv_format = FORMATS[fmt]
        require_format(kvhal_target, kv_format)
        require_dtype(kvhal_target, dtype)
        geometry = distinct_geometry(kv_format, dtype)
        strides, contiguity = [], []
        for layout in offered_layouts(kvhal_target, kvhal_device):
            cache = guarded.kv_cache(kvhal_device, geometry, layout)
            strides += _stride_problems(cache, layout)
            if layout.is_cross_layer:
                contiguity += _contiguity_problems(cache, layout)
        broken = [c for c, found in (("alloc.layout", strides), ("alloc.cross_layer", contiguity)) if found]
        expect(
            not broken,
            broken,
            lambda: (
                f"{kvhal_target.label} hook kvhal_allocate_kv_cache ({str(dtype).removeprefix('torch.')}, "
                f"{fmt}) returned views not laid out in the "
                "layout the cache is labelled with (kernels index it by that layout): "
                + "; ".join((strides + contiguity)[:6])
            ),
        )

    @final
    @covers("layouts.backend")
    def test_backend_layouts_are_offered(
        self, kvhal_target: Target, kvhal_device: Device, kvhal_backends: tuple[str, ...]
    ) -> None:
        """Every layout a backend name's answer holds (vLLM's names, the plugin's ATTENTION_BACKENDS,
        kvhal_backends) is in the default answer and allocates (small bf16 stacked cache)."""
        hook = "kvhal_kv_layouts"
        try:
            declared = kvhal_target.declared_backends()
        except ValueError as exc:
            violated("layouts.backend", str(exc))
        names = [b for b in dict.fromkeys((*self.attention_backends, *kvhal_backends, *declared)) if b]
        try:
            default = {layout.stride_order: layout for layout in kvhal_device.kv_layouts()}
        except MalformedResultError as exc:  # test_layouts_are_permutations says why
            pytest.skip(f"kvhal_kv_layouts(None) of {kvhal_target.label} is malformed: {exc}")
        answers: dict[tuple[int, ...], list[str]] = {}
        found: dict[tuple[int, ...], KVLayout] = {}
        for name in names:
            try:
                result = kvhal_target.caller(hook)(attention_backend=name)
            except Exception:  # test_layouts_are_permutations says why (layouts.sequence)
                continue
            if isinstance(result, (str, bytes)) or not isinstance(result, Sequence):
                continue
            for layout in result:
                if isinstance(layout, KVLayout) and sorted(layout.stride_order) == list(PERMUTATION):
                    answers.setdefault(tuple(layout.stride_order), []).append(name)
                    found.setdefault(tuple(layout.stride_order), layout)
        problems = []
        for order, layout in found.items():
            asked = f"{hook}({', '.join(repr(n) for n in answers[order])}) answers layout {layout}"
            refused = _allocation_problem(kvhal_target, kvhal_device, layout)
            if order not in default:
                problems.append(
                    f"{asked}, which {hook}(None) does not offer ({', '.join(map(str, default.values()))}): "
                    "kvhal allocates only layouts of the default answer, so an engine on that backend gets "
                    "no cache in the layout its kernels read; "
                    + (
                        f"and it cannot be allocated either: {refused}; answer only layouts the device "
                        "allocates"
                        if refused
                        else "add it to the default answer"
                    )
                )
            elif refused:
                problems.append(f"{asked}, which the default answer offers, but {refused}")
        expect(not problems, "layouts.backend", lambda: f"{kvhal_target.label}: " + "; ".join(problems))


def _allocation_problem(target: Target, device: Device, layout: KVLayout) -> str | None:
    """Why ``kvhal_allocate_kv_cache`` cannot allocate a small bf16 stacked cache in ``layout``
    (the raw hook: kvhal's facade would refuse a layout its default answer lacks, or a
    cross-layer one undeclared, which is layouts.cross_layer's to judge), or None."""
    geometry = small_geometry()
    try:
        cache = target.caller("kvhal_allocate_kv_cache")(
            geometry=geometry, layout=layout, device=device.torch_device
        )
    except Exception as exc:
        return f"kvhal_allocate_kv_cache({describe(layout, geometry)}) raised {type(exc).__name__}: {exc}"
    if not isinstance(cache, KVCache) or cache.layout != layout:
        return (
            f"kvhal_allocate_kv_cache({describe(layout, geometry)}) returned {cache!r:.80}, not a cache in it"
        )
    return None
