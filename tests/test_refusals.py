"""Every refusal names its culprit (plugin and hook, or argument) before any byte moves.

One focused test per error path of the device facade's result checks, its copy
planning, and the KV cache / copy-structure validation.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import kvhal
from kvhal.cache import KVCache, allocate_dense_kv_cache, dense_kv_cache, dense_nbytes
from kvhal.cpu import CPUPlugin
from kvhal.descriptor import DeviceDescriptor
from kvhal.errors import CopyValidationError, MalformedResultError, PluginError, ValidationError
from kvhal.geometry import KVFormat, KVGeometry
from kvhal.hookspecs import hookimpl
from kvhal.layouts import BLHNC, LBHNC, KVLayout
from kvhal.registry import PluginRegistry
from tests.helpers import fill_random_bytes, snapshot

GEOMETRY = KVGeometry(
    num_layers=2, num_blocks=4, block_size=4, num_kv_heads=2, head_size=8, dtype=torch.float32
)


def bound(plugin: CPUPlugin, name: str) -> kvhal.Device:
    """``plugin`` registered beside the built-in CPU one, and selected."""
    registry = PluginRegistry(autoload=False, allow=None, block=())
    registry.register(plugin, name, "tests")
    return registry.select(name)


def assert_names(error: PluginError, plugin: str, hook: str) -> None:
    assert (error.plugin, error.distribution, error.hook) == (plugin, "tests", hook)
    assert f"plugin {plugin!r} (distribution tests), hook {hook}" in str(error)


def drained_copy_refused(device: kvhal.Device, src: Any, dst: Any, mapping: Any) -> pytest.ExceptionInfo:
    """Try ``copy_blocks`` on a stream of its own; drain that stream before returning."""
    stream = device.create_stream()
    with pytest.raises(ValidationError) as raised:
        device.copy_blocks(src, dst, mapping, stream)
    done = device.create_event()
    device.record_event(done, stream)
    device.synchronize_event(done)
    return raised


def host_cache(cpu: kvhal.Device, geometry: KVGeometry = GEOMETRY, layout: KVLayout = LBHNC) -> KVCache:
    cache = cpu.allocate_host_cache(geometry, layout, geometry.num_blocks)
    fill_random_bytes(cache, seed=geometry.num_blocks)
    return cache


# -- 1. the facade refuses malformed plugin results ------------------------------


class _ReturnsNone(CPUPlugin):
    @hookimpl
    def kvhal_create_stream(self, device: torch.device) -> None:
        return None

    @hookimpl
    def kvhal_create_event(self, device: torch.device) -> None:
        return None

    @hookimpl
    def kvhal_current_stream(self, device: torch.device) -> None:
        return None


@pytest.mark.parametrize(
    ("call", "hook"),
    [
        ("create_stream", "kvhal_create_stream"),
        ("create_event", "kvhal_create_event"),
        ("current_stream", "kvhal_current_stream"),
    ],
)
def test_hook_returning_none_where_a_result_is_required(call: str, hook: str) -> None:
    device = bound(_ReturnsNone(), "nothing")
    with pytest.raises(MalformedResultError, match="returned None") as raised:
        getattr(device, call)()
    assert_names(raised.value, "nothing", hook)


class _CacheOnMeta(CPUPlugin):
    @hookimpl
    def kvhal_allocate_kv_cache(
        self, geometry: KVGeometry, layout: KVLayout, device: torch.device
    ) -> KVCache:
        return allocate_dense_kv_cache(geometry, layout, "meta")


def test_cache_allocated_on_the_wrong_device_type() -> None:
    device = bound(_CacheOnMeta(), "elsewhere")
    with pytest.raises(MalformedResultError, match="returned a cache on meta, not cpu") as raised:
        device.allocate_kv_cache(GEOMETRY, LBHNC)
    assert_names(raised.value, "elsewhere", "kvhal_allocate_kv_cache")


class _BadHostBuffer(CPUPlugin):
    def __init__(self, make: Any) -> None:
        super().__init__()
        self.make = make

    @hookimpl
    def kvhal_allocate_host_buffer(self, nbytes: int) -> Any:
        return self.make(nbytes)


@pytest.mark.parametrize(
    ("make", "phrase"),
    [
        pytest.param(
            lambda n: torch.zeros(2, n, dtype=torch.uint8), "expected a flat CPU byte tensor", id="2d"
        ),
        pytest.param(
            lambda n: torch.zeros(n, dtype=torch.float32), "expected a flat CPU byte tensor", id="float"
        ),
        pytest.param(
            lambda n: torch.zeros(n, dtype=torch.uint8, device="meta"),
            "expected a flat CPU byte tensor",
            id="not-cpu",
        ),
        pytest.param(lambda n: bytearray(n), "expected a flat CPU byte tensor", id="not-a-tensor"),
        pytest.param(
            lambda n: torch.zeros(n - 1, dtype=torch.uint8), "returned 4095 bytes; 4096 asked", id="short"
        ),
        pytest.param(
            lambda n: torch.zeros(n + 8192, dtype=torch.uint8)[1 : n + 1],
            "address not 4096-byte aligned",
            id="misaligned",
        ),
    ],
)
def test_malformed_host_buffer(make: Any, phrase: str) -> None:
    device = bound(_BadHostBuffer(make), "hostile")
    with pytest.raises(MalformedResultError, match=phrase) as raised:
        device.allocate_host_buffer(4096)
    assert_names(raised.value, "hostile", "kvhal_allocate_host_buffer")


class _PinnedAnswersInt(CPUPlugin):
    @hookimpl
    def kvhal_host_buffer_is_pinned(self, buffer: torch.Tensor) -> Any:
        return 1


def test_host_buffer_is_pinned_not_a_bool() -> None:
    device = bound(_PinnedAnswersInt(), "vague")
    buffer = device.allocate_host_buffer(4096)
    with pytest.raises(MalformedResultError, match="returned 1; expected bool") as raised:
        device.host_buffer_is_pinned(buffer)
    assert_names(raised.value, "vague", "kvhal_host_buffer_is_pinned")


class _QueryAnswersString(CPUPlugin):
    @hookimpl
    def kvhal_query_event(self, event: Any) -> Any:
        return "done"


def test_query_event_not_a_bool() -> None:
    device = bound(_QueryAnswersString(), "chatty")
    event = device.create_event()
    device.record_event(event, device.create_stream())
    with pytest.raises(MalformedResultError, match="returned 'done'; expected bool") as raised:
        device.query_event(event)
    assert_names(raised.value, "chatty", "kvhal_query_event")


# -- 2. Device.plan_copy refusals --------------------------------------------------


@pytest.mark.parametrize("side", ["src", "dst"])
def test_copy_with_a_cache_on_an_unsupported_device_type(cpu: kvhal.Device, side: str) -> None:
    host = host_cache(cpu)
    meta = allocate_dense_kv_cache(GEOMETRY, LBHNC, "meta")
    before = snapshot(host)
    src, dst = (meta, host) if side == "src" else (host, meta)
    raised = drained_copy_refused(cpu, src, dst, [(0, 1), (1, 2)])
    assert isinstance(raised.value, CopyValidationError)
    assert raised.value.argument == side
    assert "is on meta; device 'cpu' copies ['cpu']" in str(raised.value)
    assert snapshot(host) == before


def _narrow(registry: PluginRegistry) -> kvhal.Device:
    """The CPU plugin bound with no capability declared (as tests/test_bad_input.py)."""
    return kvhal.Device(
        registry.pm,
        "cpu",
        "kvhal (built-in)",
        DeviceDescriptor("cpu", "cpu", "generic", capabilities=frozenset(), priority=0),
    )


@pytest.mark.parametrize(
    ("geometry", "layout", "argument", "capability"),
    [
        pytest.param(
            KVGeometry(2, 4, 4, 2, 8, torch.float8_e4m3fn), LBHNC, "geometry", "dtype.float8_e4m3fn", id="fp8"
        ),
        pytest.param(GEOMETRY, BLHNC, "layout", "layout.cross_layer", id="cross-layer"),
        pytest.param(
            KVGeometry(2, 4, 4, 2, 8, torch.float32, kv_format=KVFormat.SPLIT),
            LBHNC,
            "geometry",
            "kv.split",
            id="split",
        ),
    ],
)
def test_copy_needing_an_undeclared_capability(
    cpu: kvhal.Device,
    registry: PluginRegistry,
    geometry: KVGeometry,
    layout: KVLayout,
    argument: str,
    capability: str,
) -> None:
    src, dst = host_cache(cpu, geometry, layout), host_cache(cpu, geometry, layout)
    fill_random_bytes(dst, seed=99)
    before_src, before_dst = snapshot(src), snapshot(dst)
    narrow = _narrow(registry)
    raised = drained_copy_refused(narrow, src, dst, [(0, 0), (1, 1)])
    assert isinstance(raised.value, CopyValidationError)
    assert raised.value.argument == argument
    assert f"does not declare capability {capability}" in str(raised.value)
    assert snapshot(src) == before_src and snapshot(dst) == before_dst


# -- 3. KVCache and copy-structure validation ----------------------------------------


def _views(geometry: KVGeometry = GEOMETRY) -> list[torch.Tensor]:
    return [torch.zeros(geometry.layer_shape(0), dtype=geometry.dtype) for _ in range(geometry.num_layers)]


def _refused(layers: Any, phrase: str, geometry: KVGeometry = GEOMETRY) -> None:
    with pytest.raises(ValidationError, match=phrase) as raised:
        KVCache(geometry, LBHNC, layers)
    assert raised.value.argument == "layers"


def test_cache_with_the_wrong_layer_count() -> None:
    _refused(tuple((v,) for v in _views()[:1]), "1 layers given, geometry has 2")


def test_cache_with_the_wrong_number_of_parts() -> None:
    a, b = _views()
    _refused(((a,), (a, b)), "layer 1 has 2 tensors, stacked needs 1")


def test_cache_with_a_view_of_the_wrong_shape() -> None:
    a, _ = _views()
    _refused(((a,), (a[:, :1],)), r"layer 1 part 0 has shape \(4, 1, 4, 16\), expected \[B, H, N, C\]")


def test_cache_with_a_view_of_the_wrong_dtype() -> None:
    a, b = _views()
    _refused(((a,), (b.half(),)), "layer 1 part 0 is torch.float16, expected torch.float32")


def test_cache_with_views_on_mixed_devices() -> None:
    a, b = _views()
    _refused(((a,), (b.to("meta"),)), r"views span several devices: \['cpu', 'meta'\]")


def test_wrap_of_no_layers() -> None:
    with pytest.raises(ValidationError, match="at least one layer is needed") as raised:
        KVCache.wrap([], LBHNC)
    assert raised.value.argument == "layers"


@pytest.mark.parametrize(
    ("shape", "strides"),
    [
        # A block stride of 0 (an ``expand``-ed view): every block is the same bytes.
        pytest.param((4, 2, 4, 16), (0, 64, 16, 1), id="block-stride-0"),
        # Block stride 64 = one head: block b's head 1 is block b+1's head 0, so a copy into
        # block b+1 would overwrite block b (before this check, copy_blocks accepted it and
        # the destination ended wrong).
        pytest.param((4, 2, 4, 16), (64, 64, 16, 1), id="partly-overlapping-blocks"),
    ],
)
def test_cache_whose_blocks_overlap_in_memory_is_refused(shape, strides) -> None:
    bases = [torch.zeros(4 * 64 + 128) for _ in range(GEOMETRY.num_layers)]
    views = [base.as_strided(shape, strides) for base in bases]
    with pytest.raises(ValidationError, match="may map two elements to the same memory") as raised:
        KVCache.wrap(views, LBHNC, storage=bases)
    assert raised.value.argument == "layers"


def test_interleaved_blocks_are_not_overlap() -> None:
    """Heads outermost (LHBNC-like): a block's runs span more than its stride, yet no byte is shared."""
    bases = [torch.zeros(2 * 4 * 64) for _ in range(GEOMETRY.num_layers)]
    views = [base.as_strided((4, 2, 4, 16), (64, 4 * 64, 16, 1)) for base in bases]
    cache = KVCache.wrap(views, LBHNC, storage=bases)
    assert cache.segments.runs_per_block > 0


@pytest.mark.parametrize(
    ("buffer", "kwargs", "phrase"),
    [
        pytest.param(
            torch.zeros(2, 4096, dtype=torch.uint8),
            {},
            r"must be a flat byte tensor, got torch.uint8 \(2, 4096\)",
            id="2d",
        ),
        pytest.param(
            torch.zeros(4096, dtype=torch.float32),
            {},
            "must be a flat byte tensor, got torch.float32",
            id="float",
        ),
        pytest.param(
            torch.zeros(dense_nbytes(GEOMETRY) - 1, dtype=torch.uint8),
            {},
            rf"{dense_nbytes(GEOMETRY) - 1} bytes given, {dense_nbytes(GEOMETRY)} needed",
            id="short",
        ),
        pytest.param(
            torch.zeros(dense_nbytes(GEOMETRY) + 8, dtype=torch.uint8)[1:],
            {},
            "address and alignment must be multiples of the torch.float32 item size",
            id="misaligned-address",
        ),
        pytest.param(
            torch.zeros(dense_nbytes(GEOMETRY, 6) + 64, dtype=torch.uint8),
            {"alignment": 6},
            "address and alignment must be multiples of the torch.float32 item size",
            id="misaligned-alignment",
        ),
    ],
)
def test_dense_kv_cache_refuses_a_bad_buffer(buffer: torch.Tensor, kwargs: dict, phrase: str) -> None:
    before = buffer.view(torch.uint8).clone()
    with pytest.raises(ValidationError, match=phrase) as raised:
        dense_kv_cache(GEOMETRY, LBHNC, buffer, **kwargs)
    assert raised.value.argument == "buffer"
    assert torch.equal(buffer.view(torch.uint8), before)


def test_copy_to_a_cache_laid_out_unlike_the_source(cpu: kvhal.Device) -> None:
    """Same geometry and layout name, but padding between heads splits each block in two runs."""
    bases = [torch.randn(4 * 2 * 80) for _ in range(GEOMETRY.num_layers)]
    views = [base.as_strided((4, 2, 4, 16), (160, 80, 16, 1)) for base in bases]
    padded = KVCache.wrap(views, LBHNC, storage=bases)
    host = host_cache(cpu)
    before_src, before_dst = snapshot(padded), snapshot(host)
    raised = drained_copy_refused(cpu, host, padded, [(0, 0), (1, 1)])
    assert isinstance(raised.value, CopyValidationError)
    assert raised.value.argument == "dst"
    assert "its blocks are laid out unlike the source's (4 vs 2 runs per block)" in str(raised.value)
    assert snapshot(padded) == before_src and snapshot(host) == before_dst
