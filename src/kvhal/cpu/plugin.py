"""The built-in CPU device plugin: kvhal's reference implementation of every device hook.

It serves engines whose KV cache lives in host memory (vLLM's CPU platform)
and is what every other plugin is measured against by the conformance suite.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvhal import env
from kvhal.cache import KVCache, allocate_dense_kv_cache
from kvhal.copyplan import CopyPlan
from kvhal.cpu import memory
from kvhal.cpu.copy_engine import CopyEngine
from kvhal.cpu.streams import CPUEvent, CPUStream, InlineStream
from kvhal.cpu.witness import MlockWitness
from kvhal.descriptor import Capability, DeviceDescriptor, Refusal, dtype_capability
from kvhal.geometry import KVGeometry
from kvhal.hookspecs import hookimpl
from kvhal.layouts import BLHNC, BLNHC, LBHNC, STANDARD_LAYOUTS, KVLayout, layouts_from_engine
from kvhal.witness import PinningWitness

#: vLLM 0.32's CPU backends that read fixed layouts (backend name -> layouts, preferred first),
#: used when vLLM itself does not answer: the CPU attention backend reads only LBHNC
#: (``cpu_attn.py:73``; ``TORCH_SDPA`` and ``CPU`` are older names), DeepSeek-V4's CPU
#: indexer inherits DEEPSEEK_V4_INDEXER's B-outermost pair (``models/deepseek_v4/cpu/cpu_mla.py``).
VLLM_CPU_BACKEND_LAYOUTS: dict[str, tuple[KVLayout, ...]] = {
    "CPU_ATTN": (LBHNC,),
    "TORCH_SDPA": (LBHNC,),
    "CPU": (LBHNC,),
    "CPU_V4_INDEXER": (BLHNC, BLNHC),
}


class CPUPlugin:
    """Implements every device hook for ``torch.device("cpu")``."""

    def __init__(self, copy_threads: int | None = None) -> None:
        threads = copy_threads or int(env.read("KVHAL_CPU_COPY_THREADS") or 0) or None
        self.engine = CopyEngine(threads)
        self._compute = InlineStream()
        self._lock_policy: memory.LockPolicy | None = None

    def lock_policy(self) -> memory.LockPolicy:
        """Whether host buffers are locked: decided once, so what the probe
        declares (``host.pinned``) is what allocation does."""
        if self._lock_policy is None:
            self._lock_policy = memory.lock_policy()
        return self._lock_policy

    @hookimpl
    def kvhal_probe(self) -> DeviceDescriptor | Refusal:
        policy = self.lock_policy()
        caps = {
            Capability.CROSS_LAYER,
            Capability.SPLIT_KV,
            Capability.ASYNC_COPY,
            Capability.BATCHED_COPY,
            Capability.FP8,
            Capability.FAULTS,
            # raw bytes: kvhal.vllm.cache_shapes moves K and V of different dtypes as uint8
            # rows; the copies are memcpy of byte runs, so any dtype copies alike
            dtype_capability(torch.uint8),
        }
        if policy.lock:
            caps.add(Capability.PINNED_HOST)
        return DeviceDescriptor(
            name="cpu",
            torch_device_type="cpu",
            vendor="generic",
            capabilities=frozenset(caps),
            priority=0,
            details={
                "torch": torch.__version__,
                "copy_engine": self.engine.name,
                "copy_threads": str(self.engine.threads),
                "non_temporal_threshold": str(self.engine.nt_threshold),
                "host_memory": f"page-aligned, pre-faulted; {policy.reason}",
            },
        )

    @hookimpl
    def kvhal_kv_layouts(self, attention_backend: str | None) -> Sequence[KVLayout]:
        if attention_backend is None:
            # Torch-level CPU kernels index any strided view.
            return STANDARD_LAYOUTS
        derived = layouts_from_engine(attention_backend, any_layout=STANDARD_LAYOUTS)
        if derived is not None:
            return derived
        return VLLM_CPU_BACKEND_LAYOUTS.get(attention_backend.upper(), STANDARD_LAYOUTS)

    @hookimpl
    def kvhal_allocate_kv_cache(
        self, geometry: KVGeometry, layout: KVLayout, device: torch.device
    ) -> KVCache:
        return allocate_dense_kv_cache(geometry, layout, device)

    @hookimpl
    def kvhal_allocate_host_buffer(self, nbytes: int) -> torch.Tensor:
        return memory.allocate(nbytes, self.lock_policy())

    @hookimpl
    def kvhal_free_host_buffer(self, buffer: torch.Tensor) -> None:
        memory.release(buffer)

    @hookimpl
    def kvhal_host_buffer_is_pinned(self, buffer: torch.Tensor) -> bool:
        return memory.is_locked(buffer)

    @hookimpl
    def kvhal_pinning_witnesses(self) -> Sequence[PinningWitness]:
        # The kernel's view of mlock, for every plugin whose buffers are cpu tensors.
        return (MlockWitness(),)

    @hookimpl
    def kvhal_create_stream(self, device: torch.device) -> CPUStream:
        return CPUStream()

    @hookimpl
    def kvhal_current_stream(self, device: torch.device) -> InlineStream:
        return self._compute

    @hookimpl
    def kvhal_create_event(self, device: torch.device) -> CPUEvent:
        return CPUEvent()

    @hookimpl
    def kvhal_record_event(self, event: CPUEvent, stream: CPUStream | InlineStream) -> None:
        stream.record(event)

    @hookimpl
    def kvhal_query_event(self, event: CPUEvent) -> bool:
        return event.query()

    @hookimpl
    def kvhal_synchronize_event(self, event: CPUEvent) -> None:
        event.synchronize()

    @hookimpl
    def kvhal_stream_wait_event(self, stream: CPUStream | InlineStream, event: CPUEvent) -> None:
        stream.wait_event(event)

    @hookimpl
    def kvhal_device_memory_in_use(self) -> int | None:
        # a cpu device's memory is host memory, allocated through malloc (torch's CPU tensors):
        # what it has handed out, not what it keeps for reuse. None (no answer) without glibc.
        return memory.allocated_bytes()

    @hookimpl
    def kvhal_inject_device_fault(self, fault: str, stream: CPUStream | InlineStream, seconds: float) -> bool:
        # Streams made by kvhal_create_stream run their work on a thread of their own; the
        # compute stream is the caller's thread: nothing to arm there. A copy error is armed
        # on the copy engine (the next batch it runs: the suite arms it on an idle stream
        # and copies at once), a stall and an event error as work queued on the stream.
        if not isinstance(stream, CPUStream):
            return False
        if fault == "copy_error":
            self.engine.fail_next_run()
        elif fault == "stream_stall":
            stream.stall(seconds)
        elif fault == "event_error":
            stream.fail_next_event()
        else:
            return False
        return True

    @hookimpl
    def kvhal_copy_blocks(self, plan: CopyPlan, stream: CPUStream | InlineStream) -> CPUEvent:
        engine = self.engine

        def copy() -> None:
            # The closure keeps ``plan``, whose caches own the memory, alive until it ran.
            engine.run(*plan.descriptors)

        stream.submit(copy)
        done = CPUEvent()
        stream.record(done)
        return done
