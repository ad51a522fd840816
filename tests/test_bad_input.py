"""Bad input gets a clear error naming the culprit, before any byte moves."""

from __future__ import annotations

import pytest
import torch

import kvhal
from kvhal.errors import CopyValidationError, ValidationError
from kvhal.geometry import KVGeometry
from kvhal.layouts import BLHNC, LBHNC
from tests.helpers import block_bytes, drain, fill_random_bytes, snapshot


def make(cpu, dtype=torch.bfloat16, head_size=8, layout=LBHNC, blocks=8):
    g = KVGeometry(
        num_layers=2, num_blocks=blocks, block_size=4, num_kv_heads=2, head_size=head_size, dtype=dtype
    )
    cache = cpu.allocate_kv_cache(g, layout)
    fill_random_bytes(cache, seed=blocks + head_size)
    return cache


@pytest.mark.parametrize(
    ("mapping", "message"),
    [
        ([(8, 0)], r"src block ids out of range \[0, 8\): \[8\]"),
        ([(0, 4)], r"dst block ids out of range \[0, 4\): \[4\]"),
        ([(-1, 0)], r"src block ids out of range"),
        ([(0, 1), (2, 1)], r"duplicate destination block ids: \[1\]"),
        ([(0, 1, 2)], r"shape \(1, 3\)"),
        ([(0.5, 1)], r"must be integers"),
    ],
)
def test_bad_mapping_moves_nothing(cpu, mapping, message):
    src = make(cpu)
    host = cpu.allocate_host_cache(src.geometry, LBHNC, 4)
    fill_random_bytes(host, seed=9)
    before_src, before_dst = snapshot(src), snapshot(host)
    with pytest.raises(CopyValidationError, match=message) as info:
        cpu.copy_blocks(src, host, mapping)
    assert info.value.argument == "mapping"
    drain(cpu)
    assert snapshot(src) == before_src and snapshot(host) == before_dst


def test_dtype_mismatch(cpu):
    src, dst = make(cpu, torch.bfloat16), make(cpu, torch.float16)
    before = snapshot(dst)
    with pytest.raises(
        CopyValidationError, match=r"dst: geometry differs from src \(dtype: torch.bfloat16 vs"
    ):
        cpu.copy_blocks(src, dst, [(0, 0)])
    drain(cpu)
    assert snapshot(dst) == before


def test_shape_mismatch(cpu):
    src, dst = make(cpu, head_size=8), make(cpu, head_size=16)
    with pytest.raises(CopyValidationError, match=r"head_size: 8 vs 16"):
        cpu.copy_blocks(src, dst, [(0, 0)])


def test_layout_mismatch(cpu):
    src, dst = make(cpu, layout=LBHNC), make(cpu, layout=BLHNC)
    with pytest.raises(CopyValidationError, match="layout BLHNC differs from src layout LBHNC"):
        cpu.copy_blocks(src, dst, [(0, 0)])


def test_same_cache_refused(cpu):
    src = make(cpu)
    with pytest.raises(CopyValidationError, match="shares memory with src"):
        cpu.copy_blocks(src, src, [(0, 1)])


def test_not_a_cache(cpu):
    with pytest.raises(CopyValidationError, match="src: must be a KVCache"):
        cpu.copy_blocks(torch.zeros(4), make(cpu), [(0, 0)])


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"num_layers": 0}, "num_layers"),
        ({"num_blocks": -3}, "num_blocks"),
        ({"block_size": 2.5}, "block_size"),
        ({"dtype": "bf16"}, "dtype"),
        ({"kv_format": "interleaved"}, "kv_format"),
        ({"head_size_v": -1}, "head_size_v"),
    ],
)
def test_bad_geometry(kwargs, argument):
    base = {
        "num_layers": 2,
        "num_blocks": 4,
        "block_size": 4,
        "num_kv_heads": 2,
        "head_size": 8,
        "dtype": torch.float32,
    }
    with pytest.raises(ValidationError) as info:
        KVGeometry(**{**base, **kwargs})
    assert info.value.argument == argument


def test_put_kv_validates_before_writing(cpu):
    cache = make(cpu)
    before = snapshot(cache)
    good = kvhal.get_kv_from_block(cache, 1)
    with pytest.raises(ValidationError, match="block_id: 8 is out of range"):
        kvhal.put_kv_into_block(cache, 8, good)
    with pytest.raises(ValidationError, match=r"kv: part 0 is torch.float32, cache holds torch.bfloat16"):
        kvhal.put_kv_into_block(cache, 1, good.float())
    with pytest.raises(ValidationError, match=r"kv: part 0 has shape \(1, 2, 4, 16\)"):
        kvhal.put_kv_into_block(cache, 1, good[:1])
    with pytest.raises(ValidationError, match="takes 1 tensor"):
        kvhal.put_kv_into_block(cache, 1, (good, good))
    assert snapshot(cache) == before


def test_put_then_get(cpu):
    cache = make(cpu, layout=BLHNC)
    before = [block_bytes(kvhal.get_kv_from_block(cache, b)) for b in range(cache.num_blocks)]
    kv = torch.randn(2, 2, 4, 16).to(torch.bfloat16)
    kvhal.put_kv_into_block(cache, 3, kv)
    assert torch.equal(kvhal.get_kv_from_block(cache, 3), kv)
    for b in range(cache.num_blocks):
        if b != 3:
            assert block_bytes(kvhal.get_kv_from_block(cache, b)) == before[b]


def test_unsupported_capability_named(cpu, registry):
    from kvhal.descriptor import DeviceDescriptor

    narrow = kvhal.Device(
        registry.pm,
        "cpu",
        "kvhal (built-in)",
        DeviceDescriptor("cpu", "cpu", "generic", capabilities=frozenset(), priority=0),
    )
    g = KVGeometry(2, 4, 4, 2, 8, torch.float8_e4m3fn)
    with pytest.raises(ValidationError, match=r"does not declare capability dtype\.float8_e4m3fn"):
        narrow.allocate_kv_cache(g, LBHNC)
    with pytest.raises(ValidationError, match=r"does not declare capability layout\.cross_layer"):
        narrow.allocate_kv_cache(KVGeometry(2, 4, 4, 2, 8, torch.float32), BLHNC)


@pytest.mark.parametrize(
    ("size", "why"),
    [("8XB", "could not interpret byte unit: XB"), (-1, "not positive"), (10**30, "more than 1 EiB")],
)
@pytest.mark.parametrize("key", ["cpu_bytes_to_use", "disk_bytes_to_use"])
def test_a_malformed_size_in_the_connectors_config_names_its_key(key, size, why):
    from kvhal.vllm.extra_config import check_extra_config

    extra = {"cpu_bytes_to_use": 1 << 30, "disk_path": "/d", "disk_bytes_to_use": 1 << 30, key: size}
    with pytest.raises(ValidationError, match=f"got {size!r} \\({why}\\)") as info:
        check_extra_config(extra)
    assert info.value.argument == f"kv_connector_extra_config.{key}"
