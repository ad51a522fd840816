"""The plumbing every torch-driven accelerator plugin shares: machine facts, its
stream module, and the probe's outline.

A plugin subclasses :class:`TorchAcceleratorPlugin` and supplies what differs:
how it gathers facts, which torch module drives its streams, whether host
memory will be pinned, and the probe's decision (a pure function it can test).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from kvhal.accel.copies import EngineCopyHooks
from kvhal.accel.host_buffers import HostBufferHooks
from kvhal.descriptor import DeviceDescriptor, Refusal
from kvhal.hookspecs import hookimpl


class TorchAcceleratorPlugin(EngineCopyHooks, HostBufferHooks):
    """Stream, event, copy and host-buffer hooks plus ``kvhal_probe``, over a torch stream module.

    :param facts: facts to decide on; gathered from this process on first use when ``None``.
    :param stream_module: the torch module with ``Stream``/``Event``/``stream``
        (tests pass a fake); :meth:`default_stream_module` when ``None``.
    """

    def __init__(self, facts: Any = None, stream_module: ModuleType | None = None) -> None:
        super().__init__()
        self._facts = facts
        self._module = stream_module

    # -- what a plugin supplies -------------------------------------------------

    def gather_facts(self) -> Any:
        """What this process says about the device (driver, runtime, device count)."""
        raise NotImplementedError

    def default_stream_module(self) -> ModuleType:
        """``torch.cuda``, ``torch.npu``, ...: looked up only when first needed."""
        raise NotImplementedError

    def pins_host(self) -> bool:
        """Whether host buffers will be pinned (``host.pinned``); may raise ``ValueError``
        for a bad setting, which the probe turns into a refusal."""
        raise NotImplementedError

    def decide(self, facts: Any, engines: list[str], pinned_host: bool) -> DeviceDescriptor | Refusal:
        """The probe's answer (a pure function of its arguments)."""
        raise NotImplementedError

    # -- shared -------------------------------------------------------------------

    def machine_facts(self) -> Any:
        """The facts decisions use, gathered on first use (a method, not a property:
        older pluggy evaluates attributes while looking for hook implementations)."""
        if self._facts is None:
            self._facts = self.gather_facts()
        return self._facts

    def stream_module(self) -> ModuleType:
        return self._module if self._module is not None else self.default_stream_module()

    @hookimpl
    def kvhal_probe(self) -> DeviceDescriptor | Refusal:
        try:
            engines = self.engine_names()
            pinned_host = self.pins_host()
        except ValueError as exc:  # a bad KVHAL_* setting
            return Refusal(str(exc))
        # After engine_names, which may have refreshed the facts (an op registered late).
        return self.decide(self.machine_facts(), engines, pinned_host)
