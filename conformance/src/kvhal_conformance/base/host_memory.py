"""Contract: host memory (``kvhal_allocate_host_buffer``, ``kvhal_host_buffer_is_pinned``,
``kvhal_free_host_buffer``).

Sizes run from one byte through odd sizes (no multiple of a page) to a buffer
the size of a host tier (``Sizes.tier_bytes``: 64 MiB quick, 1 GiB full); pinning
is witnessed up to ``Sizes.witness_bytes`` (gigabytes), bounded by the machine
(:mod:`kvhal_conformance.pinning`).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvhal.descriptor import Capability
from kvhal.device import HOST_ALIGNMENT, Device
from kvhal_conformance import guarded, pinning, timing
from kvhal_conformance.base.fixtures import ContractFixtures, final
from kvhal_conformance.clauses import covers, expect, violated
from kvhal_conformance.settings import Sizes
from kvhal_conformance.target import Target
from kvhal_conformance.timing import wait_pinned

ALLOCATE, IS_PINNED, FREE = (
    "kvhal_allocate_host_buffer",
    "kvhal_host_buffer_is_pinned",
    "kvhal_free_host_buffer",
)
#: Sizes every plugin must serve; "tier" is a host tier's (see the module docstring).
SIZES = ("1", "4095", "4096", "4097", "1MiB+3", "tier")
#: Odd sizes allocated and alive at the same time.
LIVE_SIZES = (1, 7, 4095, 4097, 12289, (1 << 20) + 3, (3 << 20) + 5)
#: Written into a buffer before it is freed; allocations of the same size must not see it.
DIRT = 0xA5
REUSE_ROUNDS = 3


def nbytes_of(size: str, sizes: Sizes) -> int:
    if size == "tier":
        return sizes.tier_bytes
    if size == "1MiB+3":
        return (1 << 20) + 3
    return int(size)


def _dirt(buffer: torch.Tensor, value: int) -> int:
    return value - 256 if buffer.dtype == torch.int8 and value > 127 else value


def expect_pinned(target: Target, device: Device, buffer: torch.Tensor, nbytes: int) -> None:
    """``host.pinned``: the plugin says (within the pin timeout) that ``buffer`` is pinned."""
    expect(
        wait_pinned(device, buffer),
        "host.pinned",
        f"plugin {target.name!r} declares {Capability.PINNED_HOST.value} but {IS_PINNED} "
        f"says a {nbytes}-byte buffer from {ALLOCATE} is not pinned ({timing.pin_wait_note(device)})",
    )


class HostMemoryContract(ContractFixtures):
    """Contract ``host_memory``: host buffers of any size are flat, zeroed (also reused),
    4 KiB-aligned CPU byte tensors, independent while alive, freed without error, pinned when
    ``host.pinned`` is declared; the pinned query answers a bool and tells the truth.

    Fixtures: ``kvhal_target``, ``kvhal_device``, ``kvhal_sizes`` (its ``tier_bytes`` is the
    largest buffer); ``free_after`` (function) collects buffers allocated through the raw hook
    and frees them through it after the test. How long a buffer may take to report pinned is
    ``--kvhal-pin-timeout`` (default 60 s).
    """

    contract_id = "host_memory"

    @pytest.fixture
    def free_after(self, kvhal_target: Target) -> Iterator[list[torch.Tensor]]:
        """Buffers a check allocated through the raw hook: freed through it afterwards."""
        buffers: list[torch.Tensor] = []
        yield buffers
        for buffer in buffers:
            try:
                kvhal_target.caller(FREE)(buffer=buffer)
            except Exception as exc:
                violated(
                    "free.release", f"{kvhal_target.label} hook {FREE} raised {type(exc).__name__}: {exc}"
                )

    @final
    @covers("host.buffer", "host.aligned", "host.zeroed")
    @pytest.mark.parametrize("size", SIZES)
    def test_host_buffer_is_flat_zeroed_aligned(
        self,
        kvhal_target: Target,
        kvhal_device: Device,
        kvhal_sizes: Sizes,
        free_after: list[torch.Tensor],
        size: str,
    ) -> None:
        """A host buffer is a flat CPU byte tensor of at least the size asked for, zeroed and
        4 KiB-aligned."""
        nbytes = nbytes_of(size, kvhal_sizes)
        where = f"{ALLOCATE}(nbytes={nbytes})"
        try:
            buffer = kvhal_target.caller(ALLOCATE)(nbytes=nbytes)
        except Exception as exc:
            violated("host.buffer", f"{kvhal_target.label} hook {where} raised {type(exc).__name__}: {exc}")
        expect(
            isinstance(buffer, torch.Tensor),
            "host.buffer",
            f"{where} returned {type(buffer).__name__}; expected a torch.Tensor",
        )
        free_after.append(buffer)
        expect(
            buffer.device.type == "cpu",
            "host.buffer",
            f"{where} returned a tensor on {buffer.device}; expected host (cpu) memory",
        )
        expect(
            buffer.dim() == 1 and buffer.element_size() == 1,
            "host.buffer",
            f"{where} returned a {buffer.dtype} tensor of shape {tuple(buffer.shape)}; "
            "expected a flat int8/uint8 tensor",
        )
        expect(buffer.numel() >= nbytes, "host.buffer", f"{where} returned {buffer.numel()} bytes")
        expect(
            buffer.data_ptr() % HOST_ALIGNMENT == 0,
            "host.aligned",
            f"{where} returned address {buffer.data_ptr():#x}, not {HOST_ALIGNMENT}-byte aligned",
        )
        nonzero = int(buffer.count_nonzero())
        expect(
            nonzero == 0,
            "host.zeroed",
            f"{where} returned a buffer with {nonzero} non-zero bytes; expected zeroed memory",
        )

    @final
    @covers("host.zeroed")
    @pytest.mark.parametrize("size", ("4096", "1MiB+3", "tier"))
    def test_reused_host_buffer_is_zeroed(
        self, kvhal_target: Target, kvhal_device: Device, kvhal_sizes: Sizes, size: str
    ) -> None:
        """A buffer allocated after one of the same size was written and freed is zeroed too
        (an allocator that recycles freed buffers must clear them), up to a host tier's size."""
        nbytes = nbytes_of(size, kvhal_sizes)
        where = f"{ALLOCATE}(nbytes={nbytes})"
        for round_ in range(REUSE_ROUNDS):
            buffer = guarded.host_buffer(kvhal_device, nbytes)
            nonzero = int(buffer.count_nonzero())
            expect(
                nonzero == 0,
                "host.zeroed",
                f"plugin {kvhal_target.name!r}: {where} returned a buffer with {nonzero} non-zero bytes "
                f"(allocation {round_ + 1} of this size after freeing buffers filled with 0x{DIRT:02X}): a "
                "reused buffer came back with non-zero bytes; expected zeroed memory",
            )
            buffer.fill_(_dirt(buffer, DIRT))
            guarded.free_buffer(kvhal_device, buffer)
            del buffer

    @final
    @covers("host.distinct")
    def test_host_buffers_are_independent(
        self, kvhal_target: Target, kvhal_device: Device, kvhal_sizes: Sizes
    ) -> None:
        """Host buffers of odd sizes, and one of a host tier's, alive at the same time share no memory:
        each keeps the value written into all of it."""
        sizes = (*LIVE_SIZES, kvhal_sizes.tier_bytes)
        buffers = [guarded.host_buffer(kvhal_device, n) for n in sizes]
        for index, buffer in enumerate(buffers):
            buffer.fill_(index + 1)
        try:
            for index, (nbytes, buffer) in enumerate(zip(sizes, buffers, strict=True)):
                wrong = int((buffer[:nbytes] != index + 1).sum())
                expect(
                    wrong == 0,
                    "host.distinct",
                    f"plugin {kvhal_target.name!r}: {ALLOCATE}: {wrong} bytes of a {nbytes}-byte buffer "
                    f"changed when other live buffers (sizes {list(sizes)}) were written: buffers alive at "
                    "the same time must not share memory",
                )
        finally:
            for buffer in buffers:
                guarded.free_buffer(kvhal_device, buffer)

    @final
    @covers("free.release")
    @pytest.mark.parametrize("size", ("1", "4097", "1MiB+3", "tier"))
    def test_free_accepts_every_buffer(
        self, kvhal_target: Target, kvhal_device: Device, kvhal_sizes: Sizes, size: str
    ) -> None:
        """kvhal_free_host_buffer returns, raising nothing, for a buffer of any size, freed
        right after allocation (whatever its pin state) or after use."""
        nbytes = nbytes_of(size, kvhal_sizes)
        for used in (False, True):
            buffer = guarded.host_buffer(kvhal_device, nbytes)
            if used:
                buffer.fill_(3)
            try:
                kvhal_target.caller(FREE)(buffer=buffer)
            except Exception as exc:
                violated(
                    "free.release",
                    f"{kvhal_target.label} hook {FREE} raised {type(exc).__name__}: {exc} for a "
                    f"{nbytes}-byte buffer from {ALLOCATE} "
                    f"({'after use' if used else 'right after allocation'})",
                )

    @final
    @covers("pinned.bool", "pinned.truthful")
    def test_is_pinned_answers_bool(self, kvhal_target: Target, kvhal_device: Device) -> None:
        """kvhal_host_buffer_is_pinned answers True or False for its own buffers and for plain
        tensors, and False for a plain tensor (never pinned or registered), declared host.pinned or not."""
        buffer = guarded.host_buffer(kvhal_device, 4096)
        try:
            for what, tensor in (
                ("one of its buffers", buffer),
                ("a plain torch tensor", torch.zeros(4096, dtype=torch.uint8)),
                ("a view into one of its buffers", buffer[4:]),
            ):
                answer = kvhal_target.call(IS_PINNED, buffer=tensor)
                expect(
                    isinstance(answer, bool),
                    "pinned.bool",
                    f"{IS_PINNED}({what}) returned {answer!r}; expected a bool",
                )
            for nbytes in (4096, 1 << 20):
                plain = torch.zeros(nbytes, dtype=torch.uint8)
                expect(
                    not kvhal_target.call(IS_PINNED, buffer=plain),
                    "pinned.truthful",
                    f"plugin {kvhal_target.name!r}: {IS_PINNED} says a plain (never pinned or "
                    f"registered) {nbytes}-byte torch tensor is pinned: it must answer for the tensor it "
                    "is given, not True for any tensor",
                )
        finally:
            guarded.free_buffer(kvhal_device, buffer)

    @final
    @covers("host.pinned", "pinned.truthful")
    @pytest.mark.parametrize("size", ("4096", "16MiB+3", "tier"))
    def test_host_buffers_are_pinned(
        self, kvhal_target: Target, kvhal_device: Device, kvhal_sizes: Sizes, size: str
    ) -> None:
        """With host.pinned declared, every host buffer is pinned (or registered), up to a host
        tier's size, and a plain tensor is not."""
        kvhal_target.require(Capability.PINNED_HOST)
        nbytes = (16 << 20) + 3 if size == "16MiB+3" else nbytes_of(size, kvhal_sizes)
        buffer = guarded.host_buffer(kvhal_device, nbytes)
        try:
            expect_pinned(kvhal_target, kvhal_device, buffer, nbytes)
            plain = torch.zeros(nbytes, dtype=torch.uint8)
            expect(
                not guarded.is_pinned(kvhal_device, plain),
                "pinned.truthful",
                f"{IS_PINNED} says a plain (never pinned or registered) {nbytes}-byte torch tensor is pinned",
            )
        finally:
            guarded.free_buffer(kvhal_device, buffer)

    @final
    @covers("pinned.witness", "host.pinned")
    @pytest.mark.parametrize("size", ("4096", "16MiB+3", "large"))
    def test_pinning_is_witnessed(
        self, kvhal_target: Target, kvhal_device: Device, kvhal_sizes: Sizes, size: str
    ) -> None:
        """With host.pinned declared, every buffer the plugin says is pinned is pinned as a witness
        of its torch device type sees it (the kernel for mlock, the runtime for CUDA and HIP), not
        only as the plugin says, up to gigabytes (``large``: the preset's ``witness_bytes``, each
        bounded by the memory this machine has available)."""
        kvhal_target.require(Capability.PINNED_HOST)
        choice = pinning.chosen(kvhal_target)
        if choice.offer is None:
            pytest.skip(choice.summary())
        witness = choice.offer.witness
        asked = {"4096": (4096,), "16MiB+3": ((16 << 20) + 3,)}.get(size) or (
            kvhal_sizes.witness_bytes or (kvhal_sizes.tier_bytes,)
        )
        for wanted in asked:
            nbytes, bound = pinning.bounded(wanted, witness)
            buffer = guarded.host_buffer(kvhal_device, nbytes)
            try:
                expect_pinned(kvhal_target, kvhal_device, buffer, nbytes)
                try:
                    seen = witness.witness(buffer.data_ptr(), nbytes)
                except Exception as exc:  # the witness's fault, not the plugin's: no clause
                    pytest.fail(f"pinning witness {choice.offer.label} raised {type(exc).__name__}: {exc}")
                choice.checked.append(
                    {"bytes": nbytes, "pinned": seen.pinned, "how": seen.how, "bounded": bound or None}
                )
                if not seen.pinned:
                    violated(
                        "pinned.witness",
                        f"plugin {kvhal_target.name!r} declares {Capability.PINNED_HOST.value} and "
                        f"{IS_PINNED} says a {nbytes}-byte buffer from {ALLOCATE} is pinned, but the pinning "
                        f"witness {choice.offer.label} sees it not pinned from byte {seen.unpinned_at} on "
                        f"({seen.how}): the plugin's answer must be what the kernel or runtime shows"
                        + (f" (size {bound})" if bound else ""),
                    )
            finally:
                guarded.free_buffer(kvhal_device, buffer)
                del buffer
