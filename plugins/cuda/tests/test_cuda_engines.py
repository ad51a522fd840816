"""Which copy engines a CUDA machine offers, and the engines run against a fake vendor library."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvhal.accel.descriptors import Descriptors
from kvhal.accel.engines import CopyArgumentError, CopyJob
from kvhal.copyplan import Direction
from kvhal_cuda import native
from kvhal_cuda.engines import (
    CU_MEMCPY_BATCH,
    CUDA_MEMCPY_ASYNC,
    TORCH_COPY,
    VLLM_SWAP_BLOCKS_BATCH,
    BatchEngine,
    RuntimeLoopEngine,
    VllmSwapBlocksBatchEngine,
    cuda_engine_names,
)
from kvhal_cuda.facts import TorchFacts
from kvhal_cuda.fakes import FakeVendorLibrary

BASE = TorchFacts(torch_version="2.13.0+cu128", cuda_version="12.8", device_count=1)


@pytest.mark.parametrize(
    "changes, expected",
    [
        ({}, [TORCH_COPY]),
        ({"driver_version": 12080}, [CU_MEMCPY_BATCH, TORCH_COPY]),
        ({"driver_version": 13010}, [CU_MEMCPY_BATCH, TORCH_COPY]),
        ({"driver_version": 12060}, [TORCH_COPY]),
        ({"runtime_library": "/l/libcudart.so.12"}, [CUDA_MEMCPY_ASYNC, TORCH_COPY]),
        ({"vllm_swap_blocks_batch": True}, [VLLM_SWAP_BLOCKS_BATCH, TORCH_COPY]),
        (
            {"driver_version": 12080, "vllm_swap_blocks_batch": True, "runtime_library": "/l/libcudart.so"},
            [CU_MEMCPY_BATCH, VLLM_SWAP_BLOCKS_BATCH, CUDA_MEMCPY_ASYNC, TORCH_COPY],
        ),
        (
            {"driver_version": 12040, "vllm_swap_blocks_batch": True, "runtime_library": "/l/libcudart.so"},
            [VLLM_SWAP_BLOCKS_BATCH, CUDA_MEMCPY_ASYNC, TORCH_COPY],
        ),
    ],
)
def test_engines_offered_best_first(changes, expected):
    assert cuda_engine_names(BASE.replace(**changes)) == expected


def test_a_forced_engine_is_the_only_one():
    facts = BASE.replace(driver_version=12080)
    assert cuda_engine_names(facts, forced=CUDA_MEMCPY_ASYNC) == [CUDA_MEMCPY_ASYNC]
    with pytest.raises(ValueError, match="not an engine"):
        cuda_engine_names(facts, forced="memcpy")


class Stream:
    def __init__(self) -> None:
        self.cuda_stream = 0x5EED


def host_job(n: int, size: int, direction=Direction.D2H, early=False):
    src = np.random.default_rng(n).integers(0, 255, n * size, dtype=np.uint8)
    dst = np.zeros_like(src)
    offsets = np.arange(n, dtype=np.int64) * size
    d = Descriptors(src.ctypes.data + offsets, dst.ctypes.data + offsets[::-1].copy(), np.full(n, size))
    expected = src.reshape(n, size)[::-1].reshape(-1)
    stream = Stream()
    stream.keep_alive = src  # the descriptors point into it: it must outlive the job
    return CopyJob(None, d, direction, stream, early), dst, expected  # type: ignore[arg-type]


def test_the_batch_engine_copies_every_descriptor_on_the_jobs_stream():
    lib = FakeVendorLibrary()
    job, dst, expected = host_job(5, 64)
    BatchEngine(lib.batch_memcpy()).run(job)
    assert np.array_equal(dst, expected)
    (call,) = lib.batch_calls
    assert (call.count, call.stream, call.num_attrs, call.attrs_idx0) == (5, 0x5EED, 1, 0)


@pytest.mark.parametrize(
    "direction, early, order",
    [
        (Direction.D2H, False, native.SRC_ACCESS_ORDER_STREAM),
        (Direction.H2D, False, native.SRC_ACCESS_ORDER_STREAM),
        (Direction.H2D, True, native.SRC_ACCESS_ORDER_ANY),
    ],
)
def test_the_source_access_order_follows_the_job(direction, early, order):
    lib = FakeVendorLibrary()
    job, _, _ = host_job(2, 8, direction, early)
    BatchEngine(lib.batch_memcpy()).run(job)
    assert lib.batch_calls[0].src_access_order == order


def test_the_batch_engine_cuts_batches_at_its_limit():
    lib = FakeVendorLibrary()
    job, dst, expected = host_job(10, 16)
    BatchEngine(lib.batch_memcpy(), max_descriptors=4).run(job)
    assert [c.count for c in lib.batch_calls] == [4, 4, 2]
    assert np.array_equal(dst, expected)


def test_a_failed_batch_names_the_call_code_and_index():
    lib = FakeVendorLibrary(fail_batch=801)
    job, _, _ = host_job(3, 8)
    with pytest.raises(native.NativeError, match=r"cudaMemcpyBatchAsync returned 801: failIdx=2 of 3"):
        BatchEngine(lib.batch_memcpy()).run(job)


def test_the_runtime_loop_copies_each_descriptor_with_default_kind():
    lib = FakeVendorLibrary()
    job, dst, expected = host_job(4, 32)
    RuntimeLoopEngine(lib.runtime()).run(job)
    assert np.array_equal(dst, expected)
    assert [c[3] for c in lib.memcpy_calls] == [native.MEMCPY_DEFAULT] * 4
    assert {c[4] for c in lib.memcpy_calls} == {0x5EED}


def test_a_runtime_copy_rejecting_its_descriptor_is_an_argument_error():
    lib = FakeVendorLibrary(fail_memcpy=native.INVALID_VALUE)
    job, _, _ = host_job(2, 8)
    with pytest.raises(CopyArgumentError, match=r"cudaMemcpyAsync returned 1 \(descriptor 0 of 2\)"):
        RuntimeLoopEngine(lib.runtime()).run(job)


def test_any_other_runtime_copy_failure_is_the_engines():
    lib = FakeVendorLibrary(fail_memcpy=35)  # cudaErrorInsufficientDriver
    job, _, _ = host_job(2, 8)
    with pytest.raises(native.NativeError, match="cudaMemcpyAsync returned 35") as caught:
        RuntimeLoopEngine(lib.runtime()).run(job)
    assert not isinstance(caught.value, CopyArgumentError)


@pytest.mark.parametrize("handle", [0, 1])
def test_the_batch_engine_refuses_the_legacy_default_stream_before_calling(handle):
    lib = FakeVendorLibrary()
    job, dst, _ = host_job(2, 8)
    job.stream.cuda_stream = handle
    with pytest.raises(CopyArgumentError, match=f"legacy default stream \\(handle {handle}"):
        BatchEngine(lib.batch_memcpy()).run(job)
    assert lib.batch_calls == [] and not dst.any()


def test_the_per_thread_default_stream_is_a_real_stream_to_the_batch_call():
    lib = FakeVendorLibrary()
    job, dst, expected = host_job(2, 8)
    job.stream.cuda_stream = 2  # CU_STREAM_PER_THREAD
    BatchEngine(lib.batch_memcpy()).run(job)
    assert np.array_equal(dst, expected)


def test_a_batch_naming_an_invalid_copy_is_an_argument_error():
    lib = FakeVendorLibrary(fail_batch=native.INVALID_VALUE)  # the fake names the last copy
    job, _, _ = host_job(3, 8)
    with pytest.raises(CopyArgumentError, match="failIdx=2 of 3"):
        BatchEngine(lib.batch_memcpy()).run(job)


def test_a_batch_failing_otherwise_is_the_engines():
    lib = FakeVendorLibrary(fail_batch=801)  # CUDA_ERROR_NOT_SUPPORTED, even for a named copy
    job, _, _ = host_job(3, 8)
    with pytest.raises(native.NativeError) as caught:
        BatchEngine(lib.batch_memcpy()).run(job)
    assert not isinstance(caught.value, CopyArgumentError)


def define_swap_op(namespace: str, schema: str):
    """A CPU op with vLLM's swap_blocks_batch schema that memmoves and records its arguments."""
    import ctypes

    seen = []
    lib = torch.library.Library(namespace, "DEF")
    lib.define(schema)

    def impl(src, dst, sizes, *rest):
        seen.append((src.dtype, rest))
        for s, d, n in zip(src.tolist(), dst.tolist(), sizes.tolist(), strict=True):
            ctypes.memmove(d, s, n)

    lib.impl("swap_blocks_batch", impl, "CPU")
    return getattr(torch.ops, namespace).swap_blocks_batch, seen, lib


def test_vllms_op_gets_int64_cpu_tensors_and_the_access_order():
    op, seen, _lib = define_swap_op(
        "kvhal_test_vllm_cuda",
        "swap_blocks_batch(Tensor src_ptrs, Tensor dst_ptrs, Tensor sizes, "
        "bool is_src_access_order_any=False) -> ()",
    )
    engine = VllmSwapBlocksBatchEngine(op)
    assert engine.takes_order
    job, dst, expected = host_job(3, 16, Direction.H2D, early=True)
    engine.run(job)
    assert np.array_equal(dst, expected)
    assert seen == [(torch.int64, (True,))]


def test_vllms_three_argument_op_gets_no_access_order():
    op, seen, _lib = define_swap_op(
        "kvhal_test_vllm_xpu", "swap_blocks_batch(Tensor src_ptrs, Tensor dst_ptrs, Tensor sizes) -> ()"
    )
    engine = VllmSwapBlocksBatchEngine(op)
    job, dst, expected = host_job(2, 8)
    engine.run(job)
    assert not engine.takes_order and seen == [(torch.int64, ())]
    assert np.array_equal(dst, expected)
