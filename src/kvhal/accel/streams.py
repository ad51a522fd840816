"""The stream and event hooks, implemented once over a torch stream module.

``torch.cuda`` (CUDA and ROCm alike) and ``torch.npu`` (torch_npu) expose the
same names: ``Stream``, ``Event``, ``current_stream``, ``stream``. A plugin
mixes :class:`TorchStreamHooks` in and says which module it drives.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch

from kvhal.accel.events import CopyEvent
from kvhal.hookspecs import hookimpl


class TorchStreamHooks:
    """``kvhal_create_stream`` ... ``kvhal_stream_wait_event`` over :meth:`stream_module`."""

    def stream_module(self) -> ModuleType:
        """The torch module whose ``Stream``/``Event``/``current_stream`` this plugin uses."""
        raise NotImplementedError

    @hookimpl
    def kvhal_create_stream(self, device: torch.device) -> Any:
        return self.stream_module().Stream(device=device)

    @hookimpl
    def kvhal_current_stream(self, device: torch.device) -> Any:
        # The calling thread's current stream on ``device``: where the engine's
        # attention and KV writes run. Copies are ordered after it.
        return self.stream_module().current_stream(device)

    @hookimpl
    def kvhal_create_event(self, device: torch.device) -> CopyEvent:
        return CopyEvent(self.stream_module().Event())

    @hookimpl
    def kvhal_record_event(self, event: CopyEvent, stream: Any) -> None:
        event.record(stream)

    @hookimpl
    def kvhal_query_event(self, event: CopyEvent) -> bool:
        return event.query()

    @hookimpl
    def kvhal_synchronize_event(self, event: CopyEvent) -> None:
        event.synchronize()

    @hookimpl
    def kvhal_stream_wait_event(self, stream: Any, event: CopyEvent) -> None:
        event.wait_on(stream)
