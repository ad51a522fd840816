"""The CUDA driver/runtime and HIP runtime calls kvhal needs, through ctypes.

No compiled extension: like vLLM's ``simple_kv_offload/cuda_mem_ops.py``,
symbols are resolved at run time, so one wheel serves every CUDA and ROCm
version and a missing symbol is a fallback, not an import error.

- ``cudaMemcpyAsync`` / ``hipMemcpyAsync`` (``kind = Default``, UVA infers the
  direction) from the runtime library torch already loaded;
- ``cudaHostRegister``/``cudaHostUnregister`` (``hip*`` on ROCm) through that
  same handle, and after any non-zero code ``cudaGetLastError`` /
  ``hipGetLastError`` on it, so the failure is not left pending for torch to
  report against a later, unrelated call (vLLM #51081). torch's own
  ``torch.cuda.cudart()`` binds no ``cudaGetLastError``, and clearing through
  another runtime instance than the one that failed clears nothing (vLLM
  #50070): one handle makes the call and clears it;
- ``cuMemcpyBatchAsync`` from ``libcuda`` through ``cuGetProcAddress`` asking for
  the CUDA 12.8 ABI (nine arguments, with ``failIdx``): the driver returns the
  entry point "ABI compatible" with the requested version, so CUDA 13 drivers,
  whose default ``cuMemcpyBatchAsync`` is the ``_v2`` ABI without ``failIdx``,
  still hand out the 12.8 one (NVIDIA's cuGetProcAddress documentation; the
  same request vLLM's C++ and Python paths make);
- ``hipMemcpyBatchAsync`` (ROCm 7.1+), same nine-argument shape;
- ``cuDriverGetVersion`` and ``hipRuntimeGetVersion``;
- ``cudaPointerGetAttributes`` / ``hipPointerGetAttributes``, which the pinning
  witness (:mod:`kvhal_cuda.witness`) asks whether host memory is registered.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import numpy as np

from kvhal.accel.descriptors import Descriptors
from kvhal.accel.native import bind, load_library

#: ``cudaMemcpyDefault`` and ``hipMemcpyDefault``: direction inferred from the pointers (UVA).
MEMCPY_DEFAULT = 4
#: ``CUmemcpySrcAccessOrder`` / ``hipMemcpySrcAccessOrder`` values (cuda.h; vLLM cuda_mem_ops.py:17-21).
SRC_ACCESS_ORDER_STREAM = 1
SRC_ACCESS_ORDER_ANY = 3
#: ``cudaHostRegisterPortable`` / ``hipHostRegisterPortable``: pinned for every context.
HOST_REGISTER_PORTABLE = 1
#: The ABI vLLM resolves: CUDA 12.8's ``cuMemcpyBatchAsync`` (with ``failIdx``).
CU_MEMCPY_BATCH_ABI = 12080
#: ``CUDA_ERROR_INVALID_VALUE``, ``cudaErrorInvalidValue`` and ``hipErrorInvalidValue`` alike.
INVALID_VALUE = 1
#: What a batch call leaves in ``failIdx`` when its error concerns no single copy
#: (``SIZE_MAX``, as NVIDIA documents ``cuMemcpyBatchAsync``'s ``failIdx``).
NO_FAILED_COPY = 2**64 - 1
#: Stream handles meaning the legacy default stream: ``0`` and ``CU_STREAM_LEGACY``.
#: ``cuMemcpyBatchAsync`` rejects them with ``CUDA_ERROR_INVALID_VALUE`` (vllm#46379);
#: the per-thread default stream (``CU_STREAM_PER_THREAD``, 2) is a real stream to it.
LEGACY_STREAM_HANDLES = frozenset({0, 1})


class NativeError(RuntimeError):
    """A vendor call returned an error code.

    :param index: the copy the call names as the failing one (a batch's
        ``failIdx``, a loop's position), or ``None`` when the error concerns
        the call as a whole.
    """

    def __init__(self, call: str, code: int, detail: str = "", index: int | None = None) -> None:
        self.call, self.code, self.index = call, code, index
        super().__init__(f"{call} returned {code}{': ' + detail if detail else ''}")

    @property
    def names_a_bad_copy(self) -> bool:
        """The vendor rejected one copy's arguments (``INVALID_VALUE`` for a named copy):
        that job's pointers or sizes, not the call itself, so the call may work for others."""
        return self.code == INVALID_VALUE and self.index is not None


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


class PointerAttributes(ctypes.Structure):
    """``cudaPointerAttributes`` (CUDA 11+) / ``hipPointerAttribute_t`` (ROCm 6+): their common
    head, then room for the fields either runtime adds after it (HIP's ``isManaged`` and
    ``allocationFlags``), so a longer struct of a newer runtime never writes past this one."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("device", ctypes.c_int),
        ("devicePointer", ctypes.c_void_p),
        ("hostPointer", ctypes.c_void_p),
        ("_room", ctypes.c_uint8 * 64),
    ]


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
    :param clear_error: called after a failure to clear the runtime's pending
        error (``hipGetLastError`` for the HIP runtime's entry point; ``None``
        for the driver's ``cuMemcpyBatchAsync``, whose errors the runtime never sees).
    """

    def __init__(
        self, fn: Callable[..., int], name: str, clear_error: Callable[[], object] | None = None
    ) -> None:
        self.fn, self.name, self.clear_error = fn, name, clear_error

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
        # Preset to "no copy": a call that fails before naming a copy leaves it so.
        fail_idx = ctypes.c_size_t(NO_FAILED_COPY)
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
            if self.clear_error is not None:
                self.clear_error()
            index = fail_idx.value if fail_idx.value < count else None
            shown = "none" if index is None else str(index)
            raise NativeError(self.name, int(code), f"failIdx={shown} of {count}", index)


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
        lib, _ = load_library(path)
        try:
            return cls(lib, prefix) if lib is not None else None
        except AttributeError:
            return None

    @property
    def memcpy_name(self) -> str:
        return f"{self.prefix}MemcpyAsync"

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream_handle: int) -> None:
        code = self._memcpy_async(dst, src, nbytes, MEMCPY_DEFAULT, stream_handle)
        if code != 0:
            self.clear_error()
            raise NativeError(self.memcpy_name, int(code), self.error_string(code))

    def _function(self, suffix: str, argtypes: list[type]) -> Callable[..., int]:
        return bind(self.lib, f"{self.prefix}{suffix}", argtypes)

    def clear_error(self) -> int:
        """``cudaGetLastError``/``hipGetLastError``: clear this thread's pending error
        in this runtime; the code it cleared (0 when the library lacks the call)."""
        try:
            fn = self._function("GetLastError", [])
        except AttributeError:
            return 0
        return int(fn())

    def host_register(self, address: int, nbytes: int, flags: int = HOST_REGISTER_PORTABLE) -> int:
        """``cudaHostRegister``/``hipHostRegister``; the error code, its pending error cleared."""
        fn = self._function("HostRegister", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint])
        code = int(fn(address, nbytes, flags))
        if code != 0:
            self.clear_error()
        return code

    def host_unregister(self, address: int) -> int:
        """``cudaHostUnregister``/``hipHostUnregister``; the error code, its pending error cleared."""
        code = int(self._function("HostUnregister", [ctypes.c_void_p])(address))
        if code != 0:
            self.clear_error()
        return code

    def pointer_type(self, address: int) -> int | None:
        """``<prefix>PointerGetAttributes(&attrs, address)``'s memory type (0 unregistered, 1 host:
        pinned or registered, 2 device, 3 managed), or ``None`` when the call failed (its pending
        error cleared). Raises ``AttributeError`` when the library lacks the call."""
        fn = self._function("PointerGetAttributes", [ctypes.POINTER(PointerAttributes), ctypes.c_void_p])
        attributes = PointerAttributes()
        code = int(fn(ctypes.byref(attributes), address))
        if code != 0:
            self.clear_error()
            return None
        return int(attributes.type)

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
                self.clear_error()
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
        return BatchMemcpy(fn, name, self.clear_error)


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
