"""The CUDA/HIP pinning witness, against the fake runtime (no GPU): it believes the runtime's
pointer attributes, not the registrar's bookkeeping."""

from __future__ import annotations

import itertools

import pytest

from kvhal_cuda.fakes import FakeRuntime, FakeVendorLibrary
from kvhal_cuda.host_memory import PAGE, HostRegistrar
from kvhal_cuda.plugin import CUDAPlugin
from kvhal_cuda.witness import HIP_6, MAX_PROBES, RuntimePinningWitness, probe_offsets

GiB = 1 << 30


def registrar_on(runtime: FakeRuntime, register=None) -> HostRegistrar:
    lib = runtime.runtime()
    return HostRegistrar(register or lib.host_register, lib.host_unregister)


def witness_of(runtime: FakeRuntime, prefix: str = "cuda") -> RuntimePinningWitness:
    return RuntimePinningWitness(prefix, runtime=runtime.runtime)


def test_registered_buffers_are_witnessed_pinned_and_freed_ones_not():
    runtime = FakeRuntime()
    registrar, witness = registrar_on(runtime), witness_of(runtime)
    assert witness.unavailable() is None
    buffer = registrar.allocate(3 * PAGE + 17)
    seen = witness.witness(buffer.data_ptr(), 3 * PAGE + 17)
    assert seen.pinned and seen.unpinned_at is None
    assert "all 5 addresses asked are host-registered" in seen.how
    registrar.free(buffer)
    seen = witness.witness(buffer.data_ptr(), 3 * PAGE + 17)
    assert not seen.pinned and seen.unpinned_at == 0
    assert "memory type 0 (unregistered) at byte 0" in seen.how


def test_a_registrar_that_only_books_buffers_is_caught():
    """The negative control: registration reported done, the runtime never asked."""
    runtime = FakeRuntime()
    registrar = registrar_on(runtime, register=lambda address, nbytes: 0)
    buffer = registrar.allocate(1 << 20)
    assert registrar.is_pinned(buffer)  # what the plugin would answer
    seen = witness_of(runtime).witness(buffer.data_ptr(), 1 << 20)
    assert not seen.pinned and seen.unpinned_at == 0
    registrar.free(buffer)


def test_a_buffer_registered_in_part_is_caught_where_registration_ends():
    runtime = FakeRuntime()
    lib = runtime.runtime()
    registrar = registrar_on(runtime, register=lambda address, nbytes: lib.host_register(address, 2 * PAGE))
    buffer = registrar.allocate(8 * PAGE)
    seen = witness_of(runtime).witness(buffer.data_ptr(), 8 * PAGE)
    assert not seen.pinned and seen.unpinned_at == 2 * PAGE
    assert "2 of 9 addresses asked before it were host-registered" in seen.how
    registrar.free(buffer)


def test_an_attributes_error_is_not_pinned_and_is_cleared():
    runtime = FakeRuntime(attributes_code=1)  # CUDA before 11 on pageable memory
    registrar = registrar_on(runtime)
    buffer = registrar.allocate(PAGE)
    seen = witness_of(runtime).witness(buffer.data_ptr(), PAGE)
    assert not seen.pinned and "answers an error at byte 0" in seen.how
    assert runtime.pending == 0  # cleared through the same handle
    registrar.free(buffer)


def test_probes_cover_every_page_of_small_buffers_and_spread_over_large_ones():
    assert probe_offsets(1) == [0]
    assert probe_offsets(PAGE + 1) == [0, PAGE]
    assert probe_offsets(2 * PAGE) == [0, PAGE, 2 * PAGE - 1]
    offsets = probe_offsets(4 * GiB)
    assert len(offsets) == MAX_PROBES + 1
    assert offsets[0] == 0 and offsets[-2] == 4 * GiB - PAGE and offsets[-1] == 4 * GiB - 1
    assert max(b - a for a, b in itertools.pairwise(offsets)) <= (4 * GiB) // (MAX_PROBES - 1) + PAGE


def test_unavailable_without_a_runtime_or_its_call():
    assert RuntimePinningWitness("cuda", runtime=lambda: None).unavailable() == (
        "no libcudart is loaded in this process"
    )
    bare = FakeVendorLibrary()  # no PointerGetAttributes
    assert RuntimePinningWitness("cuda", runtime=bare.runtime).unavailable() == (
        "the cuda runtime has no cudaPointerGetAttributes"
    )
    with pytest.raises(ValueError, match="prefix 'npu' is not one of"):
        RuntimePinningWitness("npu")


def test_hip_before_rocm_6_declines_rather_than_misread_memory_types():
    old = FakeRuntime(prefix="hip", version=50700000)
    reason = witness_of(old, "hip").unavailable()
    assert reason is not None and "predates ROCm 6.0" in reason
    assert witness_of(FakeRuntime(prefix="hip", version=HIP_6 + 200000), "hip").unavailable() is None


def test_the_hip_witness_reads_hip_pointer_attributes():
    runtime = FakeRuntime(prefix="hip", version=HIP_6)
    registrar = registrar_on(runtime)
    buffer = registrar.allocate(2 * PAGE)
    witness = witness_of(runtime, "hip")
    assert witness.name == "hipPointerGetAttributes"
    assert witness.witness(buffer.data_ptr(), 2 * PAGE).pinned
    registrar.free(buffer)


def test_the_cuda_and_rocm_plugins_offer_their_runtime_witness_for_device_type_cuda():
    rocm_plugin = pytest.importorskip("kvhal_rocm.plugin", reason="kvhal-rocm is not installed here")
    (cuda,) = CUDAPlugin().kvhal_pinning_witnesses()
    (rocm,) = rocm_plugin.ROCmPlugin().kvhal_pinning_witnesses()
    assert (cuda.name, cuda.device_type) == ("cudaPointerGetAttributes", "cuda")
    assert (rocm.name, rocm.device_type) == ("hipPointerGetAttributes", "cuda")
