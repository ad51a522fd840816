"""The ctypes layer: library discovery, error reporting, absent drivers."""

from __future__ import annotations

import ctypes

import pytest
import torch

from kvhal_cuda import native
from kvhal_cuda.fakes import FakeVendorLibrary

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
