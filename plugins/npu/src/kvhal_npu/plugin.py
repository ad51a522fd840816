"""kvhal-npu's plugin object (entry point ``npu`` in group ``kvhal.plugins``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from types import ModuleType

import torch

from kvhal.accel.engines import CopyEngine
from kvhal.accel.host_buffers import PinMode, pin_mode_from_env
from kvhal.accel.plugin_base import TorchAcceleratorPlugin
from kvhal.cache import KVCache
from kvhal.descriptor import DeviceDescriptor, Refusal
from kvhal.geometry import KVGeometry
from kvhal.hookspecs import hookimpl
from kvhal.layouts import KVLayout, layouts_from_engine
from kvhal_npu.allocation import allocate_aligned_kv_cache
from kvhal_npu.engines import ASCEND_SWAP_BLOCKS_BATCH, ENGINE_ENV, npu_engine_factories, npu_engine_names
from kvhal_npu.facts import NpuFacts, decide_npu, find_ascend_op, gather_npu_facts
from kvhal_npu.host_memory import AclHost, PinnedHostBuffers
from kvhal_npu.layouts import ASCEND_BACKEND_NAMES, ASCEND_LAYOUTS, npu_kv_layouts


class NPUPlugin(TorchAcceleratorPlugin):
    """Ascend NPUs through torch_npu (``torch.npu``) and vllm-ascend's copy op.

    Copies follow :mod:`kvhal.accel.copies`: enqueued on the given stream,
    which ``Device.submit`` made wait for the compute stream in both
    directions. (vllm-ascend's own native worker orders only stores after
    compute, the state vLLM was in before #50696.)

    :param facts: facts to decide on; gathered (importing torch_npu) when ``None``.
    :param stream_module: ``torch.npu`` by default (tests pass a fake).
    :param host: pinned host memory.
    :param find_op: looks for vllm-ascend's op again when the facts say it is absent
        (:func:`~kvhal_npu.facts.find_ascend_op`, which has vllm-ascend load its ops first).
    :param acl: the AscendCL host-memory calls (``libascendcl.so`` by default).
    """

    engine_env = ENGINE_ENV

    def __init__(
        self,
        facts: NpuFacts | None = None,
        stream_module: ModuleType | None = None,
        host: PinnedHostBuffers | None = None,
        find_op: Callable[[], tuple[bool, str | None]] = find_ascend_op,
        acl: AclHost | None = None,
    ) -> None:
        super().__init__(facts, stream_module)
        self._host = host
        self._find_op = find_op
        self._acl = acl

    def gather_facts(self) -> NpuFacts:
        return gather_npu_facts()  # imports torch_npu

    def default_stream_module(self) -> ModuleType:
        return torch.npu  # type: ignore[attr-defined]

    def pins_host(self) -> bool:
        return pin_mode_from_env() is not PinMode.OFF

    def decide(self, facts: NpuFacts, engines: list[str], pinned_host: bool) -> DeviceDescriptor | Refusal:
        return decide_npu(
            facts, engines, batched=engines[0] == ASCEND_SWAP_BLOCKS_BATCH, pinned_host=pinned_host
        )

    def engine_names(self) -> list[str]:
        """The engines, looking for vllm-ascend's op again if it was absent: the chain is built
        from this at the first copy, and vllm-ascend may have loaded its ops since the probe."""
        facts = self.machine_facts()
        if not facts.ascend_op and facts.device_count > 0:
            found, absent = self._find_op()
            self._facts = facts = replace(facts, ascend_op=found, ascend_op_absent=absent)
        return npu_engine_names(facts, self.forced_engine())

    def engine_factories(self) -> dict[str, Callable[[], CopyEngine]]:
        return npu_engine_factories()

    @hookimpl
    def kvhal_kv_layouts(self, attention_backend: str | None) -> Sequence[KVLayout]:
        if attention_backend is not None and attention_backend.upper() in ASCEND_BACKEND_NAMES:
            # vllm-ascend allocates its own (K, V) tensors: "any layout" leaves the table's answer.
            derived = layouts_from_engine(attention_backend, any_layout=ASCEND_LAYOUTS)
            if derived is not None:
                return derived
        return npu_kv_layouts(attention_backend)

    @hookimpl
    def kvhal_allocate_kv_cache(
        self, geometry: KVGeometry, layout: KVLayout, device: torch.device
    ) -> KVCache:
        return allocate_aligned_kv_cache(geometry, layout, device)

    def host_buffers(self) -> PinnedHostBuffers:
        if self._host is None:
            module = self.stream_module()
            # Registration stays on the calling thread: `async` and `sync` both pin before returning.
            pin = pin_mode_from_env() is not PinMode.OFF
            self._host = PinnedHostBuffers(pin, drain=module.synchronize, acl=self._acl)
        return self._host
