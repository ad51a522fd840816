"""kvhal-rocm's plugin object (entry point ``rocm`` in group ``kvhal.plugins``)."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import torch

from kvhal import env
from kvhal.accel.engines import CopyEngine, SizeSplitEngine
from kvhal.cache import KVCache, dense_kv_cache, dense_nbytes
from kvhal.descriptor import DeviceDescriptor, Refusal
from kvhal.geometry import KVGeometry
from kvhal.hookspecs import hookimpl
from kvhal.layouts import KVLayout, layouts_from_engine
from kvhal_cuda import native
from kvhal_cuda.engines import (
    TORCH_COPY,
    VLLM_SWAP_BLOCKS_BATCH,
    BatchEngine,
    RuntimeLoopEngine,
    cuda_engine_factories,
)
from kvhal_cuda.facts import TorchFacts
from kvhal_cuda.gpu import TorchGpuPlugin
from kvhal_rocm.batching import (
    ENGINE_ENV,
    HIP_MEMCPY_ASYNC,
    HIP_MEMCPY_BATCH,
    BatchPolicy,
    rocm_engine_names,
)
from kvhal_rocm.layouts import ANY_LAYOUT, rocm_engine_name, rocm_kv_layouts, shuffle_kv_enabled
from kvhal_rocm.probe import decide_rocm

#: vLLM pads ROCm KV buffers to whole pages for MoRIIO's RDMA registration
#: (``vllm/v1/worker/utils.py`` ``allocate_kv_cache``, vllm#53974).
KV_BUFFER_ROUNDING = 4096


def hip_batch_engine(runtime: native.RuntimeLibrary, policy: BatchPolicy) -> SizeSplitEngine:
    """``hipMemcpyBatchAsync`` (chunks of at most ``policy.max_descriptors``) for descriptors
    of at least ``policy.min_bytes``, ``hipMemcpyAsync`` for the smaller ones."""
    batch = BatchEngine(runtime.batch_memcpy(), policy.max_descriptors)
    return SizeSplitEngine(batch, RuntimeLoopEngine(runtime), policy.min_bytes)


class ROCmPlugin(TorchGpuPlugin):
    """AMD GPUs through HIP: torch.cuda on a ROCm build, libamdhip64 for copies and
    host registration (``hipHostRegister``, ``hipGetLastError`` after a failure)."""

    engine_env = ENGINE_ENV
    runtime_prefix = "hip"

    def policy(self) -> BatchPolicy:
        return BatchPolicy.from_env(env.snapshot())

    def engine_names(self) -> list[str]:
        return rocm_engine_names(self.machine_facts(), self.forced_engine())

    def engine_factories(self) -> dict[str, Callable[[], CopyEngine]]:
        facts, policy = self.machine_facts(), self.policy()

        def runtime() -> native.RuntimeLibrary:
            lib = native.RuntimeLibrary.load("hip", facts.runtime_library or "libamdhip64.so")
            if lib is None:
                raise OSError(f"cannot load {facts.runtime_library}")
            return lib

        shared = cuda_engine_factories(facts)
        return {
            HIP_MEMCPY_BATCH: lambda: hip_batch_engine(runtime(), policy),
            HIP_MEMCPY_ASYNC: lambda: RuntimeLoopEngine(runtime()),
            VLLM_SWAP_BLOCKS_BATCH: shared[VLLM_SWAP_BLOCKS_BATCH],
            TORCH_COPY: shared[TORCH_COPY],
        }

    def decide(self, facts: TorchFacts, engines: list[str], pinned_host: bool) -> DeviceDescriptor | Refusal:
        try:
            policy = self.policy()
        except ValueError as exc:
            return Refusal(str(exc))
        batched = engines[0] in (HIP_MEMCPY_BATCH, VLLM_SWAP_BLOCKS_BATCH)
        return decide_rocm(facts, pinned_host=pinned_host, engines=engines, batched=batched, policy=policy)

    @hookimpl
    def kvhal_kv_layouts(self, attention_backend: str | None) -> Sequence[KVLayout]:
        if attention_backend is not None:
            derived = layouts_from_engine(rocm_engine_name(attention_backend), any_layout=ANY_LAYOUT)
            if derived is not None:
                return derived
        return rocm_kv_layouts(attention_backend, shuffle_kv_enabled(dict(os.environ)))

    @hookimpl
    def kvhal_allocate_kv_cache(
        self, geometry: KVGeometry, layout: KVLayout, device: torch.device
    ) -> KVCache:
        nbytes = -(-dense_nbytes(geometry) // KV_BUFFER_ROUNDING) * KV_BUFFER_ROUNDING
        return dense_kv_cache(geometry, layout, torch.zeros(nbytes, dtype=torch.int8, device=device))
