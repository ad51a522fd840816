"""The hooks CUDA and ROCm share: both are driven through ``torch.cuda``.

:class:`TorchGpuPlugin` implements every device hook but ``kvhal_kv_layouts``
and the probe's decision, which differ per vendor (``kvhal_cuda.plugin``,
``kvhal_rocm.plugin``). Its copies (:mod:`kvhal.accel.copies`):

1. ``Device.submit`` has already made ``stream`` wait for an event recorded
   on :meth:`kvhal_current_stream` (the engine's compute stream), in both
   directions: stores read KV compute has finished writing (vLLM #31341,
   #46278), loads write blocks compute has finished zeroing (#50696);
2. the copy is enqueued on ``stream`` only (driver calls get its handle;
   vLLM's op and ``Tensor.copy_`` run inside ``torch.cuda.stream(stream)``),
   so it starts after that wait;
3. the source may be read out of stream order (``srcAccessOrder=ANY``) only
   for loads whose host source no unfinished store writes
   (:mod:`kvhal.accel.host_writes`); stores always read in stream order
   (#39306), so the DMA engine cannot read KV before the wait is satisfied;
4. the legacy default stream is refused before anything is enqueued: it
   serializes with every blocking stream, compute included, and
   ``cuMemcpyBatchAsync`` rejects it (#46379); descriptors are cut where two
   host registrations meet (:mod:`kvhal_cuda.host_memory`).

Host memory is registered through the runtime library torch loaded (found in
``/proc/self/maps``), with one ctypes handle that also clears a failed call's
pending error (:class:`kvhal_cuda.native.RuntimeLibrary`).
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Any

import numpy as np
import torch

from kvhal.accel.host_buffers import PinMode, pin_mode_from_env
from kvhal.accel.plugin_base import TorchAcceleratorPlugin
from kvhal.cache import KVCache, allocate_dense_kv_cache
from kvhal.errors import ValidationError
from kvhal.geometry import KVGeometry
from kvhal.hookspecs import hookimpl
from kvhal.layouts import KVLayout
from kvhal.witness import PinningWitness
from kvhal_cuda import native
from kvhal_cuda.facts import TorchFacts, gather_torch_facts
from kvhal_cuda.host_memory import HostRegistrar
from kvhal_cuda.witness import RuntimePinningWitness

log = logging.getLogger(__name__)


class TorchGpuPlugin(TorchAcceleratorPlugin):
    """Every device hook over ``torch.cuda``, except ``kvhal_probe`` and ``kvhal_kv_layouts``.

    :param facts: facts to decide on; gathered from this process when ``None``.
    :param stream_module: the torch module with ``Stream``/``Event``/``stream``;
        ``torch.cuda`` by default (tests pass a fake).
    :param registrar: host memory; by default registration through the loaded
        runtime library (:func:`runtime_registrar`).
    """

    #: Name prefix of the runtime's calls: ``cuda`` (libcudart) or ``hip`` (libamdhip64).
    runtime_prefix = "cuda"

    def __init__(
        self,
        facts: TorchFacts | None = None,
        stream_module: ModuleType | None = None,
        registrar: HostRegistrar | None = None,
    ) -> None:
        super().__init__(facts, stream_module)
        self._registrar = registrar

    # -- what TorchAcceleratorPlugin asks (decide() is per vendor) ----------------

    def gather_facts(self) -> TorchFacts:
        return gather_torch_facts()

    def default_stream_module(self) -> ModuleType:
        return torch.cuda

    def pin_mode(self) -> PinMode:
        return pin_mode_from_env()

    def pins_host(self) -> bool:
        # Registration goes through the loaded runtime library; without one, nothing pins.
        return self.pin_mode() is not PinMode.OFF and self.machine_facts().runtime_library is not None

    # -- allocation ---------------------------------------------------------------

    @hookimpl
    def kvhal_allocate_kv_cache(
        self, geometry: KVGeometry, layout: KVLayout, device: torch.device
    ) -> KVCache:
        return allocate_dense_kv_cache(geometry, layout, device)

    def runtime_library(self) -> native.RuntimeLibrary | None:
        """The runtime library torch loaded (``libcudart``/``libamdhip64``), or ``None``."""
        path = self.machine_facts().runtime_library
        return native.RuntimeLibrary.load(self.runtime_prefix, path) if path else None

    def host_buffers(self) -> HostRegistrar:
        if self._registrar is None:
            mode, runtime = self.pin_mode(), None
            if mode is not PinMode.OFF:
                runtime = self.runtime_library()
                if runtime is None:
                    log.warning(
                        "kvhal: no %s runtime library could be loaded (%s); host buffers stay pageable",
                        self.runtime_prefix,
                        self.machine_facts().runtime_library or "none found in /proc/self/maps",
                    )
                    mode = PinMode.OFF
            self._registrar = runtime_registrar(mode, self.stream_module(), runtime)
        return self._registrar

    @hookimpl
    def kvhal_pinning_witnesses(self) -> tuple[PinningWitness, ...]:
        # The runtime's own record of what is registered: kvhal's bookkeeping is not asked.
        return (RuntimePinningWitness(self.runtime_prefix),)

    # -- copies -------------------------------------------------------------------

    def check_copy_stream(self, stream: Any) -> None:
        handle = getattr(stream, "cuda_stream", None)
        if handle in native.LEGACY_STREAM_HANDLES:
            raise ValidationError(
                "stream",
                f"kvhal_copy_blocks refuses the legacy default stream (cuda_stream={handle}): copies on it "
                "wait for and block every other stream, compute included, and cuMemcpyBatchAsync rejects "
                "it (vllm#46379); pass a stream from kvhal_create_stream or a torch.cuda.Stream()",
            )

    def host_split_points(self) -> np.ndarray:
        registrar = self._registrar
        return registrar.boundaries() if registrar is not None else super().host_split_points()


def runtime_registrar(
    mode: PinMode, module: ModuleType, runtime: native.RuntimeLibrary | None
) -> HostRegistrar:
    """Host registration through ``runtime`` (``cudaHostRegister`` or ``hipHostRegister``,
    portable to every context), on the caller's current device, draining the device
    before a buffer is released. ``runtime`` may be ``None`` only with ``mode`` off."""
    if runtime is None and mode is not PinMode.OFF:
        raise ValueError(f"KVHAL_PIN_HOST={mode.value} needs a runtime library to register with")
    device = module.current_device()

    def register(address: int, nbytes: int) -> int:
        assert runtime is not None
        with module.device(device):  # not device 0's context from another thread
            return runtime.host_register(address, nbytes, native.HOST_REGISTER_PORTABLE)

    def unregister(address: int) -> int:
        assert runtime is not None
        with module.device(device):
            return runtime.host_unregister(address)

    def drain() -> None:
        module.synchronize(device)

    return HostRegistrar(register, unregister, mode, before_unregister=drain)
