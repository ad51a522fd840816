"""When ROCm's ``hipMemcpyBatchAsync`` pays, and the copy engines a ROCm machine offers.

- ROCm 7.1 introduced ``hipMemcpyBatchAsync`` (vllm#41737), but up to 7.12 it
  gives nothing: 7.2.1-7.2.3 reject ``numAttrs > 0`` with ``hipErrorNotSupported``
  and with ``numAttrs == 0`` loop ``ihipMemcpy`` per copy internally
  (ROCm/clr#273). From 7.13 attributes are accepted and copies are batched.
- Batching wins only above a break-even size: on MI355X (7.13 nightly,
  ROCm/clr#273) 64 KiB copies ran at 0.63-0.68x of per-copy calls, 256 KiB at
  about 1.7x, 1 MiB at about 1.4x. Descriptors of at least
  :data:`DEFAULT_BATCH_MIN_BYTES` are batched, smaller ones copied one by one.
- Counts above 8192 fault on MI350X/gfx950 (vLLM ``cuda_mem_ops.py``,
  vllm#43018): batches are cut at :data:`MAX_BATCH_DESCRIPTORS`.

``KVHAL_ROCM_BATCH_MIN_BYTES`` and ``KVHAL_ROCM_MAX_BATCH_DESCRIPTORS`` override
the two numbers; ``KVHAL_ROCM_COPY_ENGINE`` forces one engine.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvhal.accel.engines import TorchCopyEngine, apply_forced
from kvhal_cuda.engines import VLLM_SWAP_BLOCKS_BATCH
from kvhal_cuda.facts import TorchFacts
from kvhal_rocm.versions import hip_major_minor

HIP_MEMCPY_BATCH = "hipMemcpyBatchAsync"
HIP_MEMCPY_ASYNC = "hipMemcpyAsync"
TORCH_COPY = TorchCopyEngine.name
ROCM_ENGINES = (HIP_MEMCPY_BATCH, HIP_MEMCPY_ASYNC, VLLM_SWAP_BLOCKS_BATCH, TORCH_COPY)

#: The first ROCm whose ``hipMemcpyBatchAsync`` batches (and accepts attributes).
BATCHING_MIN_HIP = (7, 13)
#: The smallest measured copy size where batching beat per-copy calls (ROCm/clr#273).
DEFAULT_BATCH_MIN_BYTES = 256 << 10
#: ``hipMemcpyBatchAsync`` faults above this many descriptors per call.
MAX_BATCH_DESCRIPTORS = 8192
ENGINE_ENV = "KVHAL_ROCM_COPY_ENGINE"
MIN_BYTES_ENV = "KVHAL_ROCM_BATCH_MIN_BYTES"
MAX_DESCRIPTORS_ENV = "KVHAL_ROCM_MAX_BATCH_DESCRIPTORS"


@dataclass(frozen=True)
class BatchPolicy:
    """Which descriptors go to one ``hipMemcpyBatchAsync`` call.

    :param min_bytes: descriptors smaller than this are copied one by one.
    :param max_descriptors: at most this many per call (never 0 on ROCm).
    """

    min_bytes: int = DEFAULT_BATCH_MIN_BYTES
    max_descriptors: int = MAX_BATCH_DESCRIPTORS

    @classmethod
    def from_env(cls, environ: dict[str, str]) -> BatchPolicy:
        """The policy, with overrides from ``environ``; raises ``ValueError`` on bad values."""
        min_bytes = _int(environ, MIN_BYTES_ENV, DEFAULT_BATCH_MIN_BYTES, minimum=0)
        max_descriptors = _int(environ, MAX_DESCRIPTORS_ENV, MAX_BATCH_DESCRIPTORS, minimum=1)
        if max_descriptors > MAX_BATCH_DESCRIPTORS:
            raise ValueError(
                f"{MAX_DESCRIPTORS_ENV}={max_descriptors} exceeds {MAX_BATCH_DESCRIPTORS}, "
                "above which hipMemcpyBatchAsync faults (vllm#43018)"
            )
        return cls(min_bytes, max_descriptors)


def _int(environ: dict[str, str], name: str, default: int, minimum: int) -> int:
    text = environ.get(name)
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not an integer") from None
    if value < minimum:
        raise ValueError(f"{name}={value} must be >= {minimum}")
    return value


def hip_batches(hip_runtime_version: int | None) -> bool:
    """Whether this HIP runtime's ``hipMemcpyBatchAsync`` really batches (7.13+)."""
    return hip_runtime_version is not None and hip_major_minor(hip_runtime_version) >= BATCHING_MIN_HIP


def rocm_engine_names(facts: TorchFacts, forced: str | None = None) -> list[str]:
    """Copy engines this ROCm machine offers, best first.

    1. ``hipMemcpyBatchAsync`` for descriptors above the break-even size, with
       ``hipMemcpyAsync`` for the rest, where the runtime really batches (7.13+);
    2. ``hipMemcpyAsync`` per coalesced descriptor;
    3. vLLM's ``swap_blocks_batch`` op when loaded (``hipMemcpyBatchAsync`` with
       ``numAttrs=0`` on 7.1+ builds: a per-copy loop up to 7.12);
    4. ``Tensor.copy_``.
    """
    names = []
    if facts.runtime_library:
        if hip_batches(facts.hip_runtime_version):
            names.append(HIP_MEMCPY_BATCH)
        names.append(HIP_MEMCPY_ASYNC)
    if facts.vllm_swap_blocks_batch:
        names.append(VLLM_SWAP_BLOCKS_BATCH)
    names.append(TORCH_COPY)
    return apply_forced(names, forced, ROCM_ENGINES, ENGINE_ENV)
