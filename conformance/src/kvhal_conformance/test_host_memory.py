"""Contract: host memory (``kvhal_allocate_host_buffer``, ``kvhal_host_buffer_is_pinned``,
``kvhal_free_host_buffer``)."""

from __future__ import annotations

import pytest
import torch

from kvhal.descriptor import Capability
from kvhal.device import HOST_ALIGNMENT, Device
from kvhal_conformance.target import Target
from kvhal_conformance.timing import PIN_TIMEOUT_S, wait_pinned

ALLOCATE, IS_PINNED, FREE = (
    "kvhal_allocate_host_buffer",
    "kvhal_host_buffer_is_pinned",
    "kvhal_free_host_buffer",
)
SIZES = (1, 4096, 4097, (1 << 20) + 3)
#: Written into a buffer before it is freed; allocations of the same size must not see it.
DIRT = 0xA5
REUSE_ROUNDS = 4


@pytest.mark.parametrize("nbytes", SIZES)
def test_host_buffer_is_flat_zeroed_aligned(kvhal_target: Target, kvhal_device: Device, nbytes: int) -> None:
    """A host buffer is a flat CPU byte tensor of at least the size asked for, zeroed and 4 KiB-aligned."""
    buffer = kvhal_target.call(ALLOCATE, nbytes=nbytes)
    where = f"{ALLOCATE}(nbytes={nbytes})"
    assert isinstance(buffer, torch.Tensor), (
        f"{where} returned {type(buffer).__name__}; expected a torch.Tensor"
    )
    assert buffer.device.type == "cpu", (
        f"{where} returned a tensor on {buffer.device}; expected host (cpu) memory"
    )
    assert buffer.dim() == 1 and buffer.element_size() == 1, (
        f"{where} returned a {buffer.dtype} tensor of shape {tuple(buffer.shape)}; "
        "expected a flat int8/uint8 tensor"
    )
    assert buffer.numel() >= nbytes, f"{where} returned {buffer.numel()} bytes"
    assert buffer.data_ptr() % HOST_ALIGNMENT == 0, (
        f"{where} returned address {buffer.data_ptr():#x}, not {HOST_ALIGNMENT}-byte aligned"
    )
    nonzero = int(buffer.count_nonzero())
    assert nonzero == 0, f"{where} returned a buffer with {nonzero} non-zero bytes; expected zeroed memory"
    kvhal_target.call(FREE, buffer=buffer)


@pytest.mark.parametrize("nbytes", (4096, (1 << 20) + 3))
def test_reused_host_buffer_is_zeroed(kvhal_target: Target, kvhal_device: Device, nbytes: int) -> None:
    """A buffer allocated after one of the same size was written and freed is zeroed too
    (an allocator that recycles freed buffers must clear them)."""
    where = f"{ALLOCATE}(nbytes={nbytes})"
    for round_ in range(REUSE_ROUNDS):
        buffer = kvhal_target.call(ALLOCATE, nbytes=nbytes)
        nonzero = int(buffer.count_nonzero())
        assert nonzero == 0, (
            f"plugin {kvhal_target.name!r}: {where} returned a buffer with {nonzero} non-zero bytes "
            f"(allocation {round_ + 1} of this size after freeing buffers filled with 0x{DIRT:02X}): "
            "a reused buffer came back with non-zero bytes; expected zeroed memory"
        )
        buffer.fill_(DIRT - 256 if buffer.dtype == torch.int8 else DIRT)
        kvhal_target.call(FREE, buffer=buffer)
        del buffer


def test_host_buffers_are_independent(kvhal_device: Device) -> None:
    """Two live host buffers do not share memory."""
    nbytes = 1 << 16
    a, b = kvhal_device.allocate_host_buffer(nbytes), kvhal_device.allocate_host_buffer(nbytes)
    a[:nbytes].fill_(1)
    b[:nbytes].fill_(2)
    assert bool((a[:nbytes] == 1).all()), f"{ALLOCATE}: writing one buffer changed another: buffers overlap"
    for buffer in (a, b):
        kvhal_device.free_host_buffer(buffer)


def test_is_pinned_answers_bool(kvhal_target: Target, kvhal_device: Device) -> None:
    """kvhal_host_buffer_is_pinned answers True or False for its own buffers and for plain
    tensors, and False for a plain tensor (never pinned or registered), declared host.pinned or not."""
    buffer = kvhal_device.allocate_host_buffer(4096)
    for what, tensor in (
        ("one of its buffers", buffer),
        ("a plain torch tensor", torch.zeros(4096, dtype=torch.uint8)),
    ):
        answer = kvhal_target.call(IS_PINNED, buffer=tensor)
        assert isinstance(answer, bool), f"{IS_PINNED}({what}) returned {answer!r}; expected a bool"
    for nbytes in (4096, 1 << 20):
        plain = torch.zeros(nbytes, dtype=torch.uint8)
        assert not kvhal_target.call(IS_PINNED, buffer=plain), (
            f"plugin {kvhal_target.name!r}: {IS_PINNED} says a plain (never pinned or registered) "
            f"{nbytes}-byte torch tensor is pinned: it must answer for the tensor it is given, not True "
            "for any tensor"
        )
    kvhal_device.free_host_buffer(buffer)


@pytest.mark.parametrize("nbytes", (4096, 16 << 20))
def test_host_buffers_are_pinned(kvhal_target: Target, kvhal_device: Device, nbytes: int) -> None:
    """With host.pinned declared, every host buffer is pinned (or registered) and a plain tensor is not."""
    kvhal_target.require(Capability.PINNED_HOST)
    buffer = kvhal_device.allocate_host_buffer(nbytes)
    assert wait_pinned(kvhal_device, buffer), (
        f"plugin {kvhal_target.name!r} declares {Capability.PINNED_HOST.value} but {IS_PINNED} says a "
        f"{nbytes}-byte buffer from {ALLOCATE} is not pinned (waited {PIN_TIMEOUT_S:.0f} s for "
        "background pinning)"
    )
    plain = torch.zeros(nbytes, dtype=torch.uint8)
    assert not kvhal_device.host_buffer_is_pinned(plain), (
        f"{IS_PINNED} says a plain (never pinned or registered) torch tensor is pinned"
    )
    kvhal_device.free_host_buffer(buffer)
