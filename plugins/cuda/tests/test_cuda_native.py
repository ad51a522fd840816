"""The ctypes layer: library discovery, error reporting, absent drivers."""

from __future__ import annotations

import ctypes

import pytest
import torch

from kvhal.accel.descriptors import Descriptors
from kvhal_cuda import native
from kvhal_cuda.fakes import FakeRuntime, FakeVendorLibrary

MAPS = """\
7f0000000000-7f0000001000 r-xp 00000000 08:01 1 /usr/lib/libtileLang/libcudart_stub.so
7f0000002000-7f0000003000 r-xp 00000000 08:01 2 /opt/venv/nvidia/cuda_runtime/lib/libcudart.so.12
7f0000004000-7f0000005000 r-xp 00000000 08:01 3 /opt/rocm/lib/libamdhip64-1a2b3c.so.7
7f0000006000-7f0000007000 rw-p 00000000 00:00 0 [heap]
"""


def test_find_loaded_library_matches_file_names_only(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text(MAPS)
    assert (
        native.find_loaded_library("libcudart", str(maps))
        == "/opt/venv/nvidia/cuda_runtime/lib/libcudart.so.12"
    )
    assert native.find_loaded_library("libamdhip64", str(maps)) == "/opt/rocm/lib/libamdhip64-1a2b3c.so.7"
    assert native.find_loaded_library("libascendcl", str(maps)) is None
    assert native.find_loaded_library("libcudart", str(tmp_path / "missing")) is None


@pytest.mark.skipif(bool(torch.version.cuda), reason="a CUDA torch loads libcudart")
def test_this_cpu_process_has_no_cuda_runtime_loaded():
    assert native.find_loaded_library("libcudart") is None


def test_without_a_driver_the_batch_call_cannot_be_resolved():
    if native.cuda_driver_version() is not None:
        pytest.skip("a CUDA driver is installed here")
    with pytest.raises(OSError, match="libcuda"):
        native.resolve_cu_memcpy_batch()


def test_runtime_library_reports_version_and_error_text():
    lib = FakeVendorLibrary(prefix="hip", version=71_300_000, fail_memcpy=101)
    text = ctypes.create_string_buffer(b"hipErrorInvalidValue")
    lib.hipGetErrorString = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_int)(
        lambda code: ctypes.addressof(text)
    )
    runtime = lib.runtime()
    assert runtime.version() == 71_300_000
    assert runtime.memcpy_name == "hipMemcpyAsync"
    with pytest.raises(native.NativeError, match="hipMemcpyAsync returned 101: hipErrorInvalidValue"):
        runtime.memcpy_async(1, 2, 3, 0)


def test_loading_a_missing_library_gives_none():
    assert native.RuntimeLibrary.load("cuda", "/nonexistent/libcudart.so.99") is None


def test_memcpy_attributes_match_the_driver_struct_layout():
    # CUmemcpyAttributes: uint srcAccessOrder; CUmemLocation {int type; int id} x2; uint flags.
    assert ctypes.sizeof(native.MemcpyAttributes) == 24
    assert native.MemcpyAttributes.flags.offset == 20


# -- pending runtime errors are cleared on the handle that failed ---------------------


def names(runtime: FakeRuntime) -> list[str]:
    return [c[0] for c in runtime.calls]


@pytest.mark.parametrize("prefix", ["cuda", "hip"])
def test_a_failed_registration_is_cleared_on_the_same_runtime(prefix):
    fake = FakeRuntime(prefix, register_codes=[2])  # cudaErrorMemoryAllocation
    runtime = native.RuntimeLibrary(fake, prefix)
    assert runtime.host_register(0x10000, 4096) == 2
    assert names(fake) == ["HostRegister", "GetLastError"] and fake.pending == 0
    assert fake.calls[0] == ("HostRegister", 0x10000, 4096, native.HOST_REGISTER_PORTABLE)


def test_the_fake_runtime_keeps_an_uncleared_error_pending():
    # Negative control: the same failing call made without RuntimeLibrary leaves the error behind.
    fake = FakeRuntime(register_codes=[2])
    assert fake.cudaHostRegister(0x10000, 4096, 1) == 2
    assert fake.pending == 2


def test_a_successful_registration_clears_nothing():
    fake = FakeRuntime()
    runtime = native.RuntimeLibrary(fake, "cuda")
    assert runtime.host_register(0x10000, 4096) == 0 and runtime.host_unregister(0x10000) == 0
    assert names(fake) == ["HostRegister", "HostUnregister"]


def test_a_failed_unregistration_is_cleared():
    fake = FakeRuntime(unregister_code=1)
    runtime = native.RuntimeLibrary(fake, "cuda")
    assert runtime.host_unregister(0x10000) == 1
    assert names(fake) == ["HostUnregister", "GetLastError"] and fake.pending == 0


def test_a_failed_runtime_copy_is_cleared_before_it_is_raised():
    fake = FakeRuntime(fail_memcpy=1)
    runtime = native.RuntimeLibrary(fake, "cuda")
    with pytest.raises(native.NativeError, match="cudaMemcpyAsync returned 1"):
        runtime.memcpy_async(1, 2, 3, 0x7F00)
    assert fake.pending == 0 and names(fake) == ["GetLastError"]


def test_a_failed_hip_batch_is_cleared_and_names_its_copy():
    fake = FakeRuntime("hip", fail_batch=1)
    runtime = native.RuntimeLibrary(fake, "hip")
    src, dst = (ctypes.create_string_buffer(16) for _ in range(2))
    d = Descriptors.from_lists([ctypes.addressof(src)] * 2, [ctypes.addressof(dst)] * 2, [8, 8])
    with pytest.raises(native.NativeError, match="failIdx=1 of 2") as caught:
        runtime.batch_memcpy()(d, False, 0x7F00)
    assert fake.pending == 0 and names(fake) == ["GetLastError"]
    assert caught.value.index == 1 and caught.value.names_a_bad_copy


def test_a_batch_error_naming_no_copy_is_the_calls_own():
    calls = []

    def fn(*args):  # never writes failIdx, as a call rejected as a whole
        calls.append(ctypes.c_size_t.from_address(args[7]).value)
        return native.INVALID_VALUE

    src = ctypes.create_string_buffer(8)
    d = Descriptors.from_lists([ctypes.addressof(src)], [ctypes.addressof(src)], [8])
    with pytest.raises(native.NativeError, match="failIdx=none of 1") as caught:
        native.BatchMemcpy(fn, "cuMemcpyBatchAsync")(d, False, 0x7F00)
    assert calls == [native.NO_FAILED_COPY]
    assert caught.value.index is None and not caught.value.names_a_bad_copy
