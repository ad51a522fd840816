"""Copy engines over the CUDA/HIP calls, and which ones a CUDA machine offers.

:func:`cuda_engine_names` is the pure decision (tested with fake facts);
:func:`build_engines` turns names into engines, resolving vendor symbols, at
the first copy. Every engine enqueues on ``job.stream``: driver and runtime
calls take its handle, vLLM's op and ``Tensor.copy_`` use the current stream,
which the plugin sets to ``job.stream`` around the call.

A vendor call that rejects one named copy with ``INVALID_VALUE`` (a batch's
``failIdx``, a loop's position) raises :class:`~kvhal.accel.engines.CopyArgumentError`:
that job's pointers were wrong, not the engine, so the chain keeps the engine.
An error that names no copy (a missing or mismatched entry point, vllm#39491)
is the engine's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvhal.accel.engines import (
    CopyArgumentError,
    CopyEngine,
    CopyJob,
    TorchCopyEngine,
    apply_forced,
    op_has_argument,
)
from kvhal_cuda import native
from kvhal_cuda.facts import TorchFacts

CU_MEMCPY_BATCH = "cuMemcpyBatchAsync"
VLLM_SWAP_BLOCKS_BATCH = "vllm._C_cache_ops.swap_blocks_batch"
CUDA_MEMCPY_ASYNC = "cudaMemcpyAsync"
TORCH_COPY = TorchCopyEngine.name
CUDA_ENGINES = (CU_MEMCPY_BATCH, VLLM_SWAP_BLOCKS_BATCH, CUDA_MEMCPY_ASYNC, TORCH_COPY)
#: Engines that send a batch of descriptors to the device in one call.
BATCHED_ENGINES = frozenset({CU_MEMCPY_BATCH, VLLM_SWAP_BLOCKS_BATCH})
#: The first CUDA release whose driver offers ``cuMemcpyBatchAsync`` (vLLM #38460).
CU_MEMCPY_BATCH_MIN_DRIVER = 12080
#: ``KVHAL_CUDA_COPY_ENGINE=<name>`` forces one engine (no fallback): benchmarks, conformance.
ENGINE_ENV = "KVHAL_CUDA_COPY_ENGINE"


def cuda_engine_names(facts: TorchFacts, forced: str | None = None) -> list[str]:
    """Copy engines this CUDA machine offers, best first; ``torch.copy_`` always last.

    1. ``cuMemcpyBatchAsync``: one driver call per copy, where the driver is 12.8+;
    2. vLLM's ``swap_blocks_batch`` op, when vLLM's compiled ops are loaded
       (itself ``cuMemcpyBatchAsync`` on 12.8+ builds, else a C++ loop);
    3. ``cudaMemcpyAsync`` per coalesced descriptor, from the loaded runtime;
    4. ``Tensor.copy_`` per descriptor.

    ``forced`` names the only engine to use.
    """
    names = []
    if facts.driver_version is not None and facts.driver_version >= CU_MEMCPY_BATCH_MIN_DRIVER:
        names.append(CU_MEMCPY_BATCH)
    if facts.vllm_swap_blocks_batch:
        names.append(VLLM_SWAP_BLOCKS_BATCH)
    if facts.runtime_library:
        names.append(CUDA_MEMCPY_ASYNC)
    names.append(TORCH_COPY)
    return apply_forced(names, forced, CUDA_ENGINES, ENGINE_ENV)


class BatchEngine:
    """A batched driver call per chunk of at most ``max_descriptors`` (0: unlimited)."""

    batched = True
    on_current_stream = False  # the stream's handle goes to the driver

    def __init__(self, call: native.BatchMemcpy, max_descriptors: int = 0) -> None:
        self.call, self.max_descriptors = call, max_descriptors
        self.name = call.name

    def run(self, job: CopyJob) -> None:
        handle = job.stream.cuda_stream
        if handle in native.LEGACY_STREAM_HANDLES:
            raise CopyArgumentError(
                f"{self.name} rejects the legacy default stream (handle {handle}, vllm#46379); "
                "enqueue on a created stream"
            )
        for chunk in job.descriptors.chunks(self.max_descriptors):
            try:
                self.call(chunk, job.source_early, handle)
            except native.NativeError as exc:
                if exc.names_a_bad_copy:
                    raise CopyArgumentError(str(exc)) from exc
                raise


class RuntimeLoopEngine:
    """``cudaMemcpyAsync``/``hipMemcpyAsync`` per descriptor on the job's stream."""

    batched = False
    on_current_stream = False  # the stream's handle goes to the runtime

    def __init__(self, runtime: native.RuntimeLibrary) -> None:
        self.runtime = runtime
        self.name = runtime.memcpy_name

    def run(self, job: CopyJob) -> None:
        handle = job.stream.cuda_stream
        d = job.descriptors
        copy = self.runtime.memcpy_async
        src, dst, sizes = d.src.tolist(), d.dst.tolist(), d.sizes.tolist()
        for i in range(len(sizes)):
            try:
                copy(dst[i], src[i], sizes[i], handle)
            except native.NativeError as exc:
                if exc.code == native.INVALID_VALUE:  # this descriptor's pointers or size
                    raise CopyArgumentError(f"{exc} (descriptor {i} of {len(sizes)})") from exc
                raise


class VllmSwapBlocksBatchEngine:
    """vLLM's ``torch.ops._C_cache_ops.swap_blocks_batch`` (runs on the current stream).

    Its schema has a fourth ``is_src_access_order_any`` argument on CUDA and
    ROCm (``_custom_ops.py:2863``); it is passed only when the schema has it.
    """

    name = VLLM_SWAP_BLOCKS_BATCH
    batched = True
    on_current_stream = True

    def __init__(self, op: Callable[..., None]) -> None:
        self.op = op
        self.takes_order = op_has_argument(op, "is_src_access_order_any")

    def run(self, job: CopyJob) -> None:
        d = job.descriptors
        args: list[object] = [
            torch.from_numpy(a.astype("int64", copy=False)) for a in (d.src, d.dst, d.sizes)
        ]
        if self.takes_order:
            args.append(job.source_early)
        self.op(*args)


def cuda_engine_factories(facts: TorchFacts) -> dict[str, Callable[[], CopyEngine]]:
    """How to build each CUDA engine in this process."""

    def runtime() -> native.RuntimeLibrary:
        lib = native.RuntimeLibrary.load("cuda", facts.runtime_library or "libcudart.so")
        if lib is None:
            raise OSError(f"cannot load {facts.runtime_library}")
        return lib

    return {
        CU_MEMCPY_BATCH: lambda: BatchEngine(native.resolve_cu_memcpy_batch()),
        VLLM_SWAP_BLOCKS_BATCH: lambda: VllmSwapBlocksBatchEngine(torch.ops._C_cache_ops.swap_blocks_batch),
        CUDA_MEMCPY_ASYNC: lambda: RuntimeLoopEngine(runtime()),
        TORCH_COPY: TorchCopyEngine,
    }
