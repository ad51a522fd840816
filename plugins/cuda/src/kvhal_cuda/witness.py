"""The CUDA and HIP runtimes' word on registered host memory: ``<prefix>PointerGetAttributes``.

Memory pinned by ``cudaHostAlloc`` or registered by ``cudaHostRegister`` (``hip*`` on
ROCm) reports memory type ``Host`` (1) at every address inside it; pageable memory
reports ``Unregistered`` (0), or an error on runtimes before CUDA 11. The witness asks
the runtime library torch loaded, the one kvhal's plugins register through, at the
first byte of every page of a buffer up to :data:`MAX_PROBES` pages, and beyond that at
:data:`MAX_PROBES` evenly spaced pages plus the last byte.

HIP numbers its memory types as CUDA does from ROCm 6.0 on (before, ``Host`` was 0):
the HIP witness declines on older runtimes rather than misread them. Ascend's
``aclrtPointerGetAttributes`` says only whether memory is on the host or the device,
and only for memory ACL allocated, not whether it is pinned: kvhal ships no witness for
``npu``.
"""

from __future__ import annotations

from collections.abc import Callable

from kvhal.accel.host_buffers import PAGE
from kvhal.witness import PinningWitness, Witnessed
from kvhal_cuda import native

#: ``cudaMemoryTypeHost`` / ``hipMemoryTypeHost`` (ROCm 6.0+): pinned or registered host memory.
MEMORY_TYPE_HOST = 1
MEMORY_TYPES = {0: "unregistered", 1: "host", 2: "device", 3: "managed"}
#: Addresses asked per buffer at most (each one runtime call).
MAX_PROBES = 4096
#: ``hipRuntimeGetVersion`` of ROCm 6.0 (``major*10**7 + minor*10**5 + patch``).
HIP_6 = 60000000
#: The runtime library of each prefix, as :func:`kvhal_cuda.native.find_loaded_library` names it.
LIBRARIES = {"cuda": "libcudart", "hip": "libamdhip64"}

RuntimeLoader = Callable[[], "native.RuntimeLibrary | None"]


def probe_offsets(nbytes: int, max_probes: int = MAX_PROBES) -> list[int]:
    """Offsets to ask about in a buffer of ``nbytes``: the start of every page when there are
    at most ``max_probes`` pages, else ``max_probes`` pages evenly spaced; and the last byte."""
    pages = -(-nbytes // PAGE)
    if pages <= max_probes:
        offsets = [page * PAGE for page in range(pages)]
    else:
        offsets = sorted({(i * (pages - 1) // (max_probes - 1)) * PAGE for i in range(max_probes)})
    if offsets[-1] != nbytes - 1:
        offsets.append(nbytes - 1)
    return offsets


def loaded_runtime(prefix: str) -> native.RuntimeLibrary | None:
    """The runtime library of ``prefix`` this process has loaded (torch loads it), or None."""
    path = native.find_loaded_library(LIBRARIES[prefix])
    return native.RuntimeLibrary.load(prefix, path) if path else None


class RuntimePinningWitness(PinningWitness):
    """Host memory registered with the CUDA (``prefix="cuda"``) or HIP (``"hip"``) runtime.

    :param prefix: ``"cuda"`` or ``"hip"``.
    :param runtime: returns the runtime library to ask (default: the one loaded in this
        process); tests pass a fake (:class:`kvhal_cuda.fakes.FakeRuntime`).
    """

    device_type = "cuda"

    def __init__(self, prefix: str = "cuda", runtime: RuntimeLoader | None = None) -> None:
        if prefix not in LIBRARIES:
            raise ValueError(f"RuntimePinningWitness: prefix {prefix!r} is not one of {sorted(LIBRARIES)}")
        self.prefix = prefix
        self.name = f"{prefix}PointerGetAttributes"
        self._load = runtime or (lambda: loaded_runtime(prefix))
        self._runtime: native.RuntimeLibrary | None = None

    def _library(self) -> native.RuntimeLibrary | None:
        if self._runtime is None:
            self._runtime = self._load()
        return self._runtime

    def unavailable(self) -> str | None:
        try:
            runtime = self._library()
        except Exception as exc:  # must not raise: a broken library is a reason
            return f"loading the {self.prefix} runtime raised {type(exc).__name__}: {exc}"
        if runtime is None:
            return f"no {LIBRARIES[self.prefix]} is loaded in this process"
        if not hasattr(runtime.lib, self.name):
            return f"the {self.prefix} runtime has no {self.name}"
        if self.prefix == "hip":
            version = runtime.version()
            if version is None or version < HIP_6:
                return f"HIP runtime {version} predates ROCm 6.0, whose memory types it numbers otherwise"
        return None

    def witness(self, address: int, nbytes: int) -> Witnessed:
        runtime = self._library()
        if runtime is None:
            raise RuntimeError(f"{self.name}: no {LIBRARIES[self.prefix]} is loaded in this process")
        offsets = probe_offsets(nbytes)
        for asked, offset in enumerate(offsets):
            kind = runtime.pointer_type(address + offset)
            if kind != MEMORY_TYPE_HOST:
                seen = "an error" if kind is None else f"memory type {kind} ({MEMORY_TYPES.get(kind, '?')})"
                return Witnessed(
                    False,
                    offset,
                    f"{self.name} answers {seen} at byte {offset} ({asked} of {len(offsets)} "
                    "addresses asked before it were host-registered)",
                )
        return Witnessed(True, None, f"{self.name}: all {len(offsets)} addresses asked are host-registered")
