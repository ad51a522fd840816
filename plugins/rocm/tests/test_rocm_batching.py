"""When hipMemcpyBatchAsync is used: ROCm 7.13+, above the break-even size, at most 8192 per call."""

from __future__ import annotations

import numpy as np
import pytest

from kvhal.accel.descriptors import Descriptors
from kvhal.accel.engines import CopyJob
from kvhal.copyplan import Direction
from kvhal_cuda import native
from kvhal_cuda.engines import VLLM_SWAP_BLOCKS_BATCH
from kvhal_cuda.facts import TorchFacts
from kvhal_cuda.fakes import FakeVendorLibrary
from kvhal_rocm.batching import (
    DEFAULT_BATCH_MIN_BYTES,
    HIP_MEMCPY_ASYNC,
    HIP_MEMCPY_BATCH,
    MAX_BATCH_DESCRIPTORS,
    TORCH_COPY,
    BatchPolicy,
    hip_batches,
    rocm_engine_names,
)
from kvhal_rocm.plugin import hip_batch_engine

HIP = TorchFacts(torch_version="2.13.0+rocm7.1", hip_version="7.1", device_count=1)


@pytest.mark.parametrize(
    "version, batches",
    [
        (None, False),
        (70_100_000, False),  # 7.1: first hipMemcpyBatchAsync, loops internally
        (70_203_000, False),  # 7.2.3: rejects numAttrs > 0 (ROCm/clr#273)
        (71_200_000, False),
        (71_300_000, True),  # 7.13: attributes accepted, copies batched
        (71_400_000, True),
        (80_000_000, True),
    ],
)
def test_only_runtimes_that_really_batch_get_the_batch_call(version, batches):
    assert hip_batches(version) is batches


@pytest.mark.parametrize(
    "changes, expected",
    [
        ({}, [TORCH_COPY]),
        ({"runtime_library": "/r/libamdhip64.so"}, [HIP_MEMCPY_ASYNC, TORCH_COPY]),
        (
            {"runtime_library": "/r/libamdhip64.so", "hip_runtime_version": 70_200_003},
            [HIP_MEMCPY_ASYNC, TORCH_COPY],
        ),
        (
            {"runtime_library": "/r/libamdhip64.so", "hip_runtime_version": 71_300_000},
            [HIP_MEMCPY_BATCH, HIP_MEMCPY_ASYNC, TORCH_COPY],
        ),
        (
            {"runtime_library": "/r/libamdhip64.so", "vllm_swap_blocks_batch": True},
            [HIP_MEMCPY_ASYNC, VLLM_SWAP_BLOCKS_BATCH, TORCH_COPY],
        ),
        ({"vllm_swap_blocks_batch": True}, [VLLM_SWAP_BLOCKS_BATCH, TORCH_COPY]),
    ],
)
def test_engines_offered_best_first(changes, expected):
    assert rocm_engine_names(HIP.replace(**changes)) == expected


def test_forcing_an_engine():
    assert rocm_engine_names(HIP, forced=HIP_MEMCPY_BATCH) == [HIP_MEMCPY_BATCH]
    with pytest.raises(ValueError, match="KVHAL_ROCM_COPY_ENGINE"):
        rocm_engine_names(HIP, forced="cuMemcpyBatchAsync")


def test_policy_defaults_and_overrides():
    assert BatchPolicy.from_env({}) == BatchPolicy(DEFAULT_BATCH_MIN_BYTES, MAX_BATCH_DESCRIPTORS)
    assert DEFAULT_BATCH_MIN_BYTES == 256 << 10 and MAX_BATCH_DESCRIPTORS == 8192
    env = {"KVHAL_ROCM_BATCH_MIN_BYTES": "1048576", "KVHAL_ROCM_MAX_BATCH_DESCRIPTORS": "1024"}
    assert BatchPolicy.from_env(env) == BatchPolicy(1 << 20, 1024)


@pytest.mark.parametrize(
    "env, message",
    [
        ({"KVHAL_ROCM_MAX_BATCH_DESCRIPTORS": "8193"}, "faults"),
        ({"KVHAL_ROCM_MAX_BATCH_DESCRIPTORS": "0"}, ">= 1"),
        ({"KVHAL_ROCM_BATCH_MIN_BYTES": "-1"}, ">= 0"),
        ({"KVHAL_ROCM_BATCH_MIN_BYTES": "lots"}, "not an integer"),
    ],
)
def test_bad_policy_values_are_refused(env, message):
    with pytest.raises(ValueError, match=message):
        BatchPolicy.from_env(env)


class Stream:
    cuda_stream = 42


def test_large_descriptors_batch_in_chunks_of_8192_and_small_ones_copy_one_by_one():
    lib = FakeVendorLibrary(prefix="hip", version=71_300_000)
    n_large, n_small, large, small = 20_000, 3, 64, 8
    src = np.random.default_rng(0).integers(0, 255, n_large * large + n_small * small, dtype=np.uint8)
    dst = np.zeros_like(src)
    sizes = np.array([large] * n_large + [small] * n_small, dtype=np.int64)
    offsets = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    d = Descriptors(src.ctypes.data + offsets, dst.ctypes.data + offsets, sizes)
    engine = hip_batch_engine(lib.runtime(), BatchPolicy(min_bytes=large, max_descriptors=8192))
    engine.run(CopyJob(None, d, Direction.D2H, Stream()))  # type: ignore[arg-type]
    assert [c.count for c in lib.batch_calls] == [8192, 8192, 20_000 - 2 * 8192]
    assert all(set(c.sizes) == {large} for c in lib.batch_calls)
    assert [c[2] for c in lib.memcpy_calls] == [small] * n_small
    assert all(c.src_access_order == native.SRC_ACCESS_ORDER_STREAM for c in lib.batch_calls)
    assert {c.stream for c in lib.batch_calls} == {42}
    assert np.array_equal(src, dst)
