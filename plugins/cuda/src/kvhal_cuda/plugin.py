"""kvhal-cuda's plugin object (entry point ``cuda`` in group ``kvhal.plugins``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kvhal.accel.engines import CopyEngine
from kvhal.descriptor import DeviceDescriptor, Refusal
from kvhal.hookspecs import hookimpl
from kvhal.layouts import KVLayout, layouts_from_engine
from kvhal_cuda.engines import BATCHED_ENGINES, ENGINE_ENV, cuda_engine_factories, cuda_engine_names
from kvhal_cuda.facts import TorchFacts
from kvhal_cuda.gpu import TorchGpuPlugin
from kvhal_cuda.layouts import cuda_any_layout, cuda_kv_layouts
from kvhal_cuda.probe import decide_cuda


class CUDAPlugin(TorchGpuPlugin):
    """NVIDIA GPUs through torch.cuda, the CUDA driver and runtime."""

    engine_env = ENGINE_ENV

    def engine_names(self) -> list[str]:
        return cuda_engine_names(self.machine_facts(), self.forced_engine())

    def engine_factories(self) -> dict[str, Callable[[], CopyEngine]]:
        return cuda_engine_factories(self.machine_facts())

    def decide(self, facts: TorchFacts, engines: list[str], pinned_host: bool) -> DeviceDescriptor | Refusal:
        return decide_cuda(
            facts, pinned_host=pinned_host, engines=engines, batched=engines[0] in BATCHED_ENGINES
        )

    @hookimpl
    def kvhal_kv_layouts(self, attention_backend: str | None) -> Sequence[KVLayout]:
        if attention_backend is None:
            return cuda_kv_layouts(None, None)
        derived = layouts_from_engine(attention_backend, any_layout=cuda_any_layout(attention_backend))
        if derived is not None:
            return derived
        major = None
        if attention_backend.upper() == "FLASHINFER":
            major = torch.cuda.get_device_capability()[0]
        return cuda_kv_layouts(attention_backend, major)
