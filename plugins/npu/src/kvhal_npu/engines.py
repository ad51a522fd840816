"""Copy engines on an Ascend NPU.

1. vllm-ascend's ``torch.ops._C_ascend.swap_blocks_batch(src, dst, sizes, direction)``
   when its compiled ops are loaded (they load lazily: the probe calls
   ``vllm_ascend.utils.enable_custom_op()`` first, and the chain built at the
   first copy looks again): ``aclrtMemcpyBatchAsync`` where it was
   built against CANN 8.5+ (``CANN_MEMCPY_BATCH_ASYNC``), else an
   ``aclrtMemcpyAsync`` loop, on the current NPU stream;
2. ``Tensor.copy_`` per descriptor (torch_npu's copies), on the current stream.

Neither takes a source-access-order hint, so every copy reads in stream order.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from kvhal.accel.engines import CopyEngine, CopyJob, TorchCopyEngine, apply_forced, op_has_argument
from kvhal.copyplan import Direction
from kvhal_npu.facts import ASCEND_OP_NAME, ASCEND_OP_NAMESPACE, NpuFacts

ASCEND_SWAP_BLOCKS_BATCH = f"vllm_ascend.{ASCEND_OP_NAMESPACE}.{ASCEND_OP_NAME}"
TORCH_COPY = TorchCopyEngine.name
NPU_ENGINES = (ASCEND_SWAP_BLOCKS_BATCH, TORCH_COPY)
ENGINE_ENV = "KVHAL_NPU_COPY_ENGINE"
#: The op's ``direction`` argument (vllm-ascend ``csrc/torch_binding.cpp``).
ASCEND_DIRECTION = {Direction.H2D: 0, Direction.D2H: 1, Direction.D2D: 2}


def npu_engine_names(facts: NpuFacts, forced: str | None = None) -> list[str]:
    """Copy engines this NPU machine offers, best first (``forced``: only that one)."""
    names = [ASCEND_SWAP_BLOCKS_BATCH] if facts.ascend_op else []
    names.append(TORCH_COPY)
    return apply_forced(names, forced, NPU_ENGINES, ENGINE_ENV)


class AscendSwapBlocksBatchEngine:
    """vllm-ascend's batch-copy op over the job's descriptors."""

    name = ASCEND_SWAP_BLOCKS_BATCH
    batched = True
    on_current_stream = True

    def __init__(self, op: Callable[..., None]) -> None:
        self.op = op
        # Stored vllm-ascend declares (Tensor x, Tensor y, Tensor z, int direction);
        # vllm-ascend#9700 (open) would drop it for vLLM's three-tensor form.
        self.takes_direction = op_has_argument(op, "direction")

    def run(self, job: CopyJob) -> None:
        d = job.descriptors
        args: list[object] = [torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)) for a in d]
        if self.takes_direction:
            if job.direction not in ASCEND_DIRECTION:
                raise ValueError(f"{self.name} has no direction code for {job.direction.value}")
            args.append(ASCEND_DIRECTION[job.direction])
        self.op(*args)


def npu_engine_factories() -> dict[str, Callable[[], CopyEngine]]:
    return {
        ASCEND_SWAP_BLOCKS_BATCH: lambda: AscendSwapBlocksBatchEngine(
            getattr(getattr(torch.ops, ASCEND_OP_NAMESPACE), ASCEND_OP_NAME)
        ),
        TORCH_COPY: TorchCopyEngine,
    }
