"""The CUDA driver/runtime and HIP runtime calls kvhal needs, through ctypes.

No compiled extension: like vLLM's ``simple_kv_offload/cuda_mem_ops.py``,
symbols are resolved at run time, so one wheel serves every CUDA and ROCm
version and a missing symbol is a fallback, not an import error.

- ``cudaMemcpyAsync`` / ``hipMemcpyAsync`` (``kind = Default``, UVA infers the
  direction) from the runtime library torch already loaded;
- ``cuMemcpyBatchAsync`` from ``libcuda`` through ``cuGetProcAddress`` asking for
  the CUDA 12.8 ABI (nine arguments, with ``failIdx``): the driver returns the
  entry point "ABI compatible" with the requested version, so CUDA 13 drivers,
  whose default ``cuMemcpyBatchAsync`` is the ``_v2`` ABI without ``failIdx``,
  still hand out the 12.8 one (NVIDIA's cuGetProcAddress documentation; the
  same request vLLM's C++ and Python paths make);
- ``hipMemcpyBatchAsync`` (ROCm 7.1+), same nine-argument shape;
- ``cuDriverGetVersion`` and ``hipRuntimeGetVersion``.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import numpy as np

from kvhal.accel.descriptors import Descriptors

#: ``cudaMemcpyDefault`` and ``hipMemcpyDefault``: direction inferred from the pointers (UVA).
MEMCPY_DEFAULT = 4
#: ``CUmemcpySrcAccessOrder`` / ``hipMemcpySrcAccessOrder`` values (cuda.h; vLLM cuda_mem_ops.py:17-21).
SRC_ACCESS_ORDER_STREAM = 1
SRC_ACCESS_ORDER_ANY = 3
#: ``cudaHostRegisterPortable`` / ``hipHostRegisterPortable``: pinned for every context.
HOST_REGISTER_PORTABLE = 1
#: The ABI vLLM resolves: CUDA 12.8's ``cuMemcpyBatchAsync`` (with ``failIdx``).
CU_MEMCPY_BATCH_ABI = 12080


class NativeError(RuntimeError):
    """A vendor call returned an error code."""

    def __init__(self, call: str, code: int, detail: str = "") -> None:
        self.call, self.code = call, code
        super().__init__(f"{call} returned {code}{': ' + detail if detail else ''}")


def find_loaded_library(prefix: str, maps: str = "/proc/self/maps") -> str | None:
    """Path of a loaded shared library named ``<prefix>.so*`` or ``<prefix>-<hash>.so*``.

    Matches the file name only, so ``libcudart_stub.so`` is no ``libcudart``.
    """
    try:
        with open(maps) as lines:
            for line in lines:
                start = line.find("/")
                if start < 0:
                    continue
                path = line[start:].strip()
                name = path.rsplit("/", 1)[-1]
                if name.startswith((f"{prefix}.so", f"{prefix}-")):
                    return path
    except OSError:
        return None
    return None


class MemLocation(ctypes.Structure):
    """``CUmemLocation`` / ``hipMemLocation``."""

    _fields_ = [("type", ctypes.c_uint), ("id", ctypes.c_int)]


class MemcpyAttributes(ctypes.Structure):
    """``CUmemcpyAttributes`` / ``hipMemcpyAttributes``."""

    _fields_ = [
        ("srcAccessOrder", ctypes.c_uint),
        ("srcLocHint", MemLocation),
        ("dstLocHint", MemLocation),
        ("flags", ctypes.c_uint),
    ]


#: ``(dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, failIdx, stream) -> CUresult/hipError_t``.
BATCH_MEMCPY_FN = ctypes.CFUNCTYPE(
    ctypes.c_uint,
    ctypes.c_void_p,
    ctypes.c_void_p,
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_void_p,
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_void_p,
    ctypes.c_void_p,
)


def _as_size_t(array: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(array, dtype=np.uint64)


class BatchMemcpy:
    """One ``cuMemcpyBatchAsync``/``hipMemcpyBatchAsync`` entry point.

    :param fn: a callable with :data:`BATCH_MEMCPY_FN`'s signature.
    :param name: the vendor symbol, for errors.
    """

    def __init__(self, fn: Callable[..., int], name: str) -> None:
        self.fn, self.name = fn, name

    def __call__(self, descriptors: Descriptors, source_early: bool, stream_handle: int) -> None:
        """Enqueue every descriptor in one call; raise :class:`NativeError` on failure.

        One attribute entry covers all copies: ``srcAccessOrder`` is ANY when
        ``source_early`` (loads whose source nothing writes), else STREAM.
        """
        count = len(descriptors)
        if not count:
            return
        dsts, srcs, sizes = (_as_size_t(a) for a in (descriptors.dst, descriptors.src, descriptors.sizes))
        attrs = MemcpyAttributes(
            srcAccessOrder=SRC_ACCESS_ORDER_ANY if source_early else SRC_ACCESS_ORDER_STREAM
        )
        attrs_idx = (ctypes.c_size_t * 1)(0)
        fail_idx = ctypes.c_size_t(0)
        code = self.fn(
            dsts.ctypes.data,
            srcs.ctypes.data,
            sizes.ctypes.data,
            count,
            ctypes.addressof(attrs),
            ctypes.addressof(attrs_idx),
            1,
            ctypes.addressof(fail_idx),
            stream_handle,
        )
        if code != 0:
            raise NativeError(self.name, int(code), f"failIdx={fail_idx.value} of {count}")


class RuntimeLibrary:
    """``libcudart`` or ``libamdhip64``: calls whose names differ only in prefix.

    :param lib: the loaded library (or any object with the same attributes).
    :param prefix: ``"cuda"`` or ``"hip"``.
    """

    def __init__(self, lib: object, prefix: str) -> None:
        self.lib, self.prefix = lib, prefix
        self._memcpy_async = getattr(lib, f"{prefix}MemcpyAsync")
        self._memcpy_async.restype = ctypes.c_int
        self._memcpy_async.argtypes = [
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_void_p,
        ]

    @classmethod
    def load(cls, prefix: str, path: str) -> RuntimeLibrary | None:
        """Load ``path``; ``None`` when it cannot be opened or lacks the calls."""
        try:
            return cls(ctypes.CDLL(path), prefix)
        except (OSError, AttributeError):
            return None

    @property
    def memcpy_name(self) -> str:
        return f"{self.prefix}MemcpyAsync"

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream_handle: int) -> None:
        code = self._memcpy_async(dst, src, nbytes, MEMCPY_DEFAULT, stream_handle)
        if code != 0:
            raise NativeError(self.memcpy_name, int(code), self.error_string(code))

    def error_string(self, code: int) -> str:
        try:
            fn = getattr(self.lib, f"{self.prefix}GetErrorString")
            fn.restype = ctypes.c_char_p
            fn.argtypes = [ctypes.c_int]
            return (fn(code) or b"").decode(errors="replace")
        except (AttributeError, TypeError):
            return ""

    def version(self) -> int | None:
        """``cudaRuntimeGetVersion`` / ``hipRuntimeGetVersion``, or ``None``."""
        value = ctypes.c_int(0)
        try:
            fn = getattr(self.lib, f"{self.prefix}RuntimeGetVersion")
            if fn(ctypes.byref(value)) != 0:
                return None
        except (AttributeError, TypeError, OSError):
            return None
        return value.value

    def batch_memcpy(self) -> BatchMemcpy:
        """``hipMemcpyBatchAsync`` of this library; raises ``AttributeError`` if absent."""
        name = f"{self.prefix}MemcpyBatchAsync"
        fn = getattr(self.lib, name)
        fn.restype = ctypes.c_uint
        fn.argtypes = list(BATCH_MEMCPY_FN._argtypes_)
        return BatchMemcpy(fn, name)


def _libcuda() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def cuda_driver_version() -> int | None:
    """``cuDriverGetVersion`` (works before ``cuInit``), or ``None`` without a driver."""
    lib = _libcuda()
    if lib is None:
        return None
    value = ctypes.c_int(0)
    try:
        if lib.cuDriverGetVersion(ctypes.byref(value)) != 0:
            return None
    except AttributeError:
        return None
    return value.value


def resolve_cu_memcpy_batch(abi: int = CU_MEMCPY_BATCH_ABI) -> BatchMemcpy:
    """``cuMemcpyBatchAsync`` with the CUDA 12.8 ABI; raises :class:`NativeError` or ``OSError``."""
    lib = _libcuda()
    if lib is None:
        raise OSError("libcuda.so.1 cannot be loaded")
    get_proc = lib.cuGetProcAddress_v2
    get_proc.restype = ctypes.c_int
    get_proc.argtypes = [
        ctypes.c_char_p,
        ctypes.POINTER(ctypes.c_void_p),
        ctypes.c_int,
        ctypes.c_uint64,
        ctypes.POINTER(ctypes.c_int),
    ]
    pointer, status = ctypes.c_void_p(), ctypes.c_int(0)
    code = get_proc(b"cuMemcpyBatchAsync", ctypes.byref(pointer), abi, 0, ctypes.byref(status))
    if code != 0 or not pointer.value:
        raise NativeError("cuGetProcAddress(cuMemcpyBatchAsync)", int(code), f"symbolStatus={status.value}")
    return BatchMemcpy(BATCH_MEMCPY_FN(pointer.value), "cuMemcpyBatchAsync")
