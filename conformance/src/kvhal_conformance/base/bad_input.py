"""Contract: bad input raises kvhal's error types and moves no byte.

kvhal checks a copy before the plugin sees it; these checks hold the pair
(kvhal and the plugin behind it) to that: after each refused call, the
streams are drained and both caches compared with their contents before.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvhal.cache import KVCache, dense_kv_cache
from kvhal.descriptor import Capability, dtype_capability
from kvhal.device import Device
from kvhal.errors import CopyValidationError, ValidationError
from kvhal.geometry import KVFormat
from kvhal.layouts import STANDARD_LAYOUTS, KVLayout
from kvhal_conformance import blockdata
from kvhal_conformance.base.fixtures import ContractFixtures, HostCache, final
from kvhal_conformance.cases import small_geometry
from kvhal_conformance.clauses import KVHAL_OWN, covers
from kvhal_conformance.target import Target
from kvhal_conformance.timing import settle, wait

DEVICE_BLOCKS, HOST_BLOCKS = 16, 12

#: name -> (mapping, how to make the destination: "host", "other dtype", "other layout", "same", "overlap")
COPIES: dict[str, tuple[list | np.ndarray, str]] = {
    "src id out of range": ([(DEVICE_BLOCKS, 0)], "host"),
    "dst id out of range": ([(0, HOST_BLOCKS)], "host"),
    "negative id": ([(-1, 0)], "host"),
    "duplicate dst": ([(0, 3), (1, 3)], "host"),
    "mapping not pairs": ([(0, 1, 2)], "host"),
    "float ids": (np.array([[0.0, 1.0]]), "host"),
    "geometry differs": ([(0, 0)], "other dtype"),
    "layout differs": ([(0, 0)], "other layout"),
    "src is dst": ([(0, 1)], "same"),
    "caches overlap": ([(0, 1)], "overlap"),
}


def _other_layout(layout: KVLayout) -> KVLayout:
    return next(x for x in STANDARD_LAYOUTS if x.stride_order != layout.stride_order)


def _destination(kind: str, src: KVCache, device: Device, host_cache: HostCache) -> KVCache:
    layout, geometry = src.layout, src.geometry.with_num_blocks(HOST_BLOCKS)
    if kind == "host":
        return host_cache(geometry, layout, HOST_BLOCKS)
    if kind == "other dtype":
        return host_cache(small_geometry(torch.float16, num_blocks=HOST_BLOCKS), layout, HOST_BLOCKS)
    if kind == "other layout":
        return host_cache(geometry, _other_layout(layout), HOST_BLOCKS)
    if kind == "same":
        return src
    assert kind == "overlap"  # a second view of the source's own memory
    return dense_kv_cache(src.geometry, src.layout, src.storage[0])


def _drain(device: Device) -> None:
    """Wait for anything a refused call might have queued anyway."""
    settle(device)
    marker = device.create_event()
    device.record_event(marker, device.default_stream)
    wait(device, marker, "draining the copy stream after a refused copy")


class BadInputContract(ContractFixtures):
    """Contract ``bad_input`` (kvhal's own checks, run on your device and caches): invalid
    copies, allocations and host buffer sizes raise kvhal's error types, and no byte moves.

    Fixtures: ``kvhal_target``, ``kvhal_device``, ``kvhal_host_cache``, ``kvhal_seed`` (see
    :class:`ContractFixtures`).
    """

    contract_id = "bad_input"

    @final
    @covers(KVHAL_OWN)
    @pytest.mark.parametrize("case", COPIES)
    def test_bad_copy_is_refused(
        self, kvhal_device: Device, kvhal_host_cache: HostCache, kvhal_seed: int, case: str
    ) -> None:
        """Out-of-range, negative, duplicate or non-integer ids, and mismatched or overlapping
        caches raise CopyValidationError; no byte moves."""
        mapping, kind = COPIES[case]
        src = kvhal_device.allocate_kv_cache(small_geometry(num_blocks=DEVICE_BLOCKS))
        dst = _destination(kind, src, kvhal_device, kvhal_host_cache)
        src_before = blockdata.fill(src, kvhal_seed)
        dst_before = src_before if dst is src else blockdata.fill(dst, kvhal_seed + 1)
        if kind == "overlap":
            src_before = dst_before
        with pytest.raises(CopyValidationError):
            kvhal_device.copy_blocks(src, dst, mapping)
        _drain(kvhal_device)
        for name, cache, before in (("src", src, src_before), ("dst", dst, dst_before)):
            changed = torch.nonzero(~blockdata.blocks_equal(blockdata.read(cache), before)).flatten().tolist()
            assert not changed, f"a refused copy ({case}) changed {name} blocks {blockdata.id_list(changed)}"

    @final
    @covers(KVHAL_OWN)
    @pytest.mark.parametrize("nbytes", (0, -1, 1.5, True))
    def test_bad_host_buffer_size_is_refused(self, kvhal_device: Device, nbytes: object) -> None:
        """A host buffer of zero, negative, fractional or boolean size raises ValidationError."""
        with pytest.raises(ValidationError):
            kvhal_device.allocate_host_buffer(nbytes)  # type: ignore[arg-type]

    @final
    @covers(KVHAL_OWN)
    def test_undeclared_capability_is_refused(self, kvhal_target: Target, kvhal_device: Device) -> None:
        """Allocating or copying what the plugin did not declare raises ValidationError naming the
        capability."""
        preferred = kvhal_device.kv_layouts()[0]
        requests = [(dtype_capability(torch.float64), small_geometry(torch.float64), preferred)]
        requests += [
            (Capability.SPLIT_KV.value, small_geometry(kv_format=KVFormat.SPLIT), preferred),
            (
                Capability.CROSS_LAYER.value,
                small_geometry(),
                next(x for x in STANDARD_LAYOUTS if x.is_cross_layer),
            ),
            (Capability.FP8.value, small_geometry(torch.float8_e4m3fn), preferred),
        ]
        for capability, geometry, layout in requests:
            if kvhal_target.declares(capability):
                continue
            with pytest.raises(ValidationError) as raised:
                kvhal_device.allocate_kv_cache(geometry, layout)
            if layout.stride_order in [x.stride_order for x in kvhal_device.kv_layouts()]:
                assert capability in str(raised.value), (
                    f"allocating with undeclared capability {capability} was refused "
                    f"without naming it: {raised.value}"
                )
