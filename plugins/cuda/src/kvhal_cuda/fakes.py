"""Stand-ins for libcudart/libamdhip64 and the batch-copy entry points, for tests on a CPU.

The fakes are real C function pointers (``ctypes.CFUNCTYPE`` callbacks) with
the vendor signatures, so the ctypes marshalling in :mod:`kvhal_cuda.native`
runs for real; they execute each copy with ``memmove`` on host memory and
record what they were given.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Any

from kvhal_cuda import native

_MEMCPY_ASYNC_FN = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p
)
_RUNTIME_VERSION_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_int))


@dataclass
class BatchCall:
    """What one batched call received."""

    count: int
    src_access_order: int
    num_attrs: int
    attrs_idx0: int
    stream: int
    sizes: list[int]


@dataclass
class FakeVendorLibrary:
    """A fake ``libcudart``/``libamdhip64`` (``prefix``) with a fake batch call.

    :param fail_batch: error code every batched call returns (0: succeed).
    :param fail_memcpy: error code every per-copy call returns (0: succeed).
    :param version: what ``<prefix>RuntimeGetVersion`` reports.
    """

    prefix: str = "cuda"
    fail_batch: int = 0
    fail_memcpy: int = 0
    version: int = 12080
    batch_calls: list[BatchCall] = field(default_factory=list)
    memcpy_calls: list[tuple[int, int, int, int, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._batch = native.BATCH_MEMCPY_FN(self._batch_impl)
        setattr(self, f"{self.prefix}MemcpyAsync", _MEMCPY_ASYNC_FN(self._memcpy_impl))
        setattr(self, f"{self.prefix}MemcpyBatchAsync", self._batch)
        setattr(self, f"{self.prefix}RuntimeGetVersion", _RUNTIME_VERSION_FN(self._version_impl))

    def batch_memcpy(self) -> native.BatchMemcpy:
        """The batch entry point as :func:`kvhal_cuda.native.resolve_cu_memcpy_batch` returns one."""
        return native.BatchMemcpy(self._batch, f"{self.prefix}MemcpyBatchAsync")

    def runtime(self) -> native.RuntimeLibrary:
        return native.RuntimeLibrary(self, self.prefix)

    def _memcpy_impl(self, dst: int, src: int, nbytes: int, kind: int, stream: Any) -> int:
        self.memcpy_calls.append((dst, src, nbytes, kind, stream or 0))
        if self.fail_memcpy:
            return self.fail_memcpy
        ctypes.memmove(dst, src, nbytes)
        return 0

    def _version_impl(self, out: Any) -> int:
        out[0] = self.version
        return 0

    def _batch_impl(
        self,
        dsts: int,
        srcs: int,
        sizes: int,
        count: int,
        attrs: int,
        attrs_idxs: int,
        num_attrs: int,
        fail_idx: int,
        stream: Any,
    ) -> int:
        def array(address: int) -> list[int]:
            return list((ctypes.c_uint64 * count).from_address(address))

        attr = native.MemcpyAttributes.from_address(attrs)
        self.batch_calls.append(
            BatchCall(
                count=count,
                src_access_order=attr.srcAccessOrder,
                num_attrs=num_attrs,
                attrs_idx0=ctypes.c_size_t.from_address(attrs_idxs).value,
                stream=stream or 0,
                sizes=array(sizes),
            )
        )
        if self.fail_batch:
            ctypes.c_size_t.from_address(fail_idx).value = count - 1
            return self.fail_batch
        for d, s, n in zip(array(dsts), array(srcs), array(sizes), strict=True):
            ctypes.memmove(d, s, n)
        return 0


_HOST_REGISTER_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint)
_HOST_UNREGISTER_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
_GET_LAST_ERROR_FN = ctypes.CFUNCTYPE(ctypes.c_int)
_POINTER_ATTRIBUTES_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)


class FakeRuntime(FakeVendorLibrary):
    """A :class:`FakeVendorLibrary` that also registers host memory and keeps a pending
    error the way the runtime does: a failing call sets it, ``<prefix>GetLastError``
    returns and clears it. ``calls`` records ``HostRegister``/``HostUnregister``/``GetLastError``.

    :param register_codes: codes successive ``<prefix>HostRegister`` calls return (then 0).
    :param unregister_code: what every ``<prefix>HostUnregister`` returns.
    :param attributes_code: what every ``<prefix>PointerGetAttributes`` returns (0: it
        answers memory type 1, host, inside a range registered and not unregistered, else 0,
        unregistered, as CUDA 11+ does).

    ``registered`` maps the address of each successful registration to its size.
    """

    def __init__(
        self,
        prefix: str = "cuda",
        register_codes: tuple[int, ...] = (),
        unregister_code: int = 0,
        attributes_code: int = 0,
        **kw: Any,
    ) -> None:
        super().__init__(prefix=prefix, **kw)
        self.register_codes = list(register_codes)
        self.unregister_code = unregister_code
        self.attributes_code = attributes_code
        self.registered: dict[int, int] = {}
        self.pending = 0
        self.calls: list[tuple[Any, ...]] = []
        setattr(self, f"{prefix}HostRegister", _HOST_REGISTER_FN(self._register))
        setattr(self, f"{prefix}HostUnregister", _HOST_UNREGISTER_FN(self._unregister))
        setattr(self, f"{prefix}GetLastError", _GET_LAST_ERROR_FN(self._get_last_error))
        setattr(self, f"{prefix}PointerGetAttributes", _POINTER_ATTRIBUTES_FN(self._attributes))

    def _fail(self, code: int) -> int:
        if code:
            self.pending = code
        return code

    def _register(self, address: Any, nbytes: int, flags: int) -> int:
        self.calls.append(("HostRegister", address or 0, nbytes, flags))
        code = self.register_codes.pop(0) if self.register_codes else 0
        if code == 0:
            self.registered[address or 0] = nbytes
        return self._fail(code)

    def _unregister(self, address: Any) -> int:
        self.calls.append(("HostUnregister", address or 0))
        if self.unregister_code == 0:
            self.registered.pop(address or 0, None)
        return self._fail(self.unregister_code)

    def _attributes(self, attributes: Any, address: Any) -> int:
        if self.attributes_code:
            return self._fail(self.attributes_code)
        address = address or 0
        inside = any(start <= address < start + size for start, size in self.registered.items())
        native.PointerAttributes.from_address(attributes).type = 1 if inside else 0
        return 0

    def _memcpy_impl(self, dst: int, src: int, nbytes: int, kind: int, stream: Any) -> int:
        return self._fail(super()._memcpy_impl(dst, src, nbytes, kind, stream))

    def _batch_impl(self, *args: Any) -> int:
        return self._fail(super()._batch_impl(*args))

    def _get_last_error(self) -> int:
        self.calls.append(("GetLastError",))
        code, self.pending = self.pending, 0
        return code
