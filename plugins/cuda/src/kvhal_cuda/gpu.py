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
   (#39306), so the DMA engine cannot read KV before the wait is satisfied.
"""

from __future__ import annotations

from types import ModuleType

import torch

from kvhal.accel.copies import EngineCopyHooks
from kvhal.accel.host_buffers import HostBufferHooks, PinMode, pin_mode_from_env
from kvhal.cache import KVCache, allocate_dense_kv_cache
from kvhal.descriptor import DeviceDescriptor, Refusal
from kvhal.geometry import KVGeometry
from kvhal.hookspecs import hookimpl
from kvhal.layouts import KVLayout
from kvhal_cuda import native
from kvhal_cuda.facts import TorchFacts, gather_torch_facts
from kvhal_cuda.host_memory import HostRegistrar


class TorchGpuPlugin(EngineCopyHooks, HostBufferHooks):
    """Every device hook over ``torch.cuda``, except ``kvhal_probe`` and ``kvhal_kv_layouts``.

    :param facts: facts to decide on; gathered from this process when ``None``.
    :param stream_module: the torch module with ``Stream``/``Event``/``stream``;
        ``torch.cuda`` by default (tests pass a fake).
    :param registrar: host memory; by default ``torch.cuda.cudart()`` registration.
    """

    def __init__(
        self,
        facts: TorchFacts | None = None,
        stream_module: ModuleType | None = None,
        registrar: HostRegistrar | None = None,
    ) -> None:
        super().__init__()
        self._facts = facts
        self._module = stream_module
        self._registrar = registrar

    # -- what subclasses decide -------------------------------------------------

    def decide(self, facts: TorchFacts, engines: list[str], pinned_host: bool) -> DeviceDescriptor | Refusal:
        """The probe's answer (a pure function of its arguments)."""
        raise NotImplementedError

    # -- shared plumbing --------------------------------------------------------

    def machine_facts(self) -> TorchFacts:
        """The facts decisions use, gathered on first use (a method, not a property:
        older pluggy evaluates attributes while looking for hook implementations)."""
        if self._facts is None:
            self._facts = gather_torch_facts()
        return self._facts

    def stream_module(self) -> ModuleType:
        return self._module if self._module is not None else torch.cuda

    def pin_mode(self) -> PinMode:
        return pin_mode_from_env()

    @hookimpl
    def kvhal_probe(self) -> DeviceDescriptor | Refusal:
        facts = self.machine_facts()
        try:
            engines = self.engine_names()
            pinned_host = self.pin_mode() is not PinMode.OFF
        except ValueError as exc:  # a bad KVHAL_* setting
            return Refusal(str(exc))
        return self.decide(facts, engines, pinned_host)

    # -- allocation ---------------------------------------------------------------

    @hookimpl
    def kvhal_allocate_kv_cache(
        self, geometry: KVGeometry, layout: KVLayout, device: torch.device
    ) -> KVCache:
        return allocate_dense_kv_cache(geometry, layout, device)

    def host_buffers(self) -> HostRegistrar:
        if self._registrar is None:
            self._registrar = cudart_registrar(self.pin_mode(), self.stream_module())
        return self._registrar


def cudart_registrar(mode: PinMode, module: ModuleType) -> HostRegistrar:
    """Host registration through ``torch.cuda.cudart()`` (``hipHostRegister`` on ROCm builds),
    on the caller's current device, draining the device before unregistering."""
    device = module.current_device() if mode is not PinMode.OFF else 0

    def register(address: int, nbytes: int) -> int:
        with module.device(device):  # not device 0's context from a fresh thread
            return int(module.cudart().cudaHostRegister(address, nbytes, native.HOST_REGISTER_PORTABLE))

    def unregister(address: int) -> int:
        with module.device(device):
            return int(module.cudart().cudaHostUnregister(address))

    def drain() -> None:
        module.synchronize(device)

    return HostRegistrar(register, unregister, mode, before_unregister=drain)
