"""What torch and the machine say about GPUs, gathered without initializing CUDA.

Probe and copy-engine decisions are pure functions of a :class:`TorchFacts`;
tests pass hand-made facts instead of patching torch. :func:`gather_torch_facts`
reads the real ones: version strings, ``torch.cuda.device_count()`` (NVML or
amdsmi based before CUDA is initialized, so a probe does not poison a later
fork, see torch's ``device_count`` note), the driver's version through
``cuDriverGetVersion`` (no ``cuInit`` needed), which vendor runtime library
the process has loaded, and whether vLLM's batch-copy op is registered.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kvhal.accel.engines import op_registered
from kvhal_cuda import native


@dataclass(frozen=True)
class TorchFacts:
    """Facts a GPU plugin decides on.

    :param torch_version: ``torch.__version__``.
    :param cuda_version: ``torch.version.cuda`` (``None`` unless a CUDA build).
    :param hip_version: ``torch.version.hip`` (``None`` unless a ROCm build).
    :param device_count: ``torch.cuda.device_count()`` (0 on builds without a GPU backend).
    :param driver_version: the CUDA driver's version as ``1000*major + 10*minor``, or ``None``.
    :param runtime_library: path of the loaded ``libcudart``/``libamdhip64``, or ``None``.
    :param hip_runtime_version: ``hipRuntimeGetVersion`` (``major*10**7 + minor*10**5 + patch``), or ``None``.
    :param vllm_swap_blocks_batch: ``torch.ops._C_cache_ops.swap_blocks_batch`` is registered
        (vLLM's compiled ops are loaded in this process).
    """

    torch_version: str
    cuda_version: str | None = None
    hip_version: str | None = None
    device_count: int = 0
    driver_version: int | None = None
    runtime_library: str | None = None
    hip_runtime_version: int | None = None
    vllm_swap_blocks_batch: bool = False

    def replace(self, **changes: object) -> TorchFacts:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


def gather_torch_facts() -> TorchFacts:
    """The real facts of this process (see the module docstring)."""
    cuda_version = torch.version.cuda
    hip_version = getattr(torch.version, "hip", None)
    compiled = torch.cuda._is_compiled()
    facts = TorchFacts(
        torch_version=torch.__version__,
        cuda_version=cuda_version,
        hip_version=hip_version,
        device_count=torch.cuda.device_count() if compiled else 0,
        vllm_swap_blocks_batch=op_registered("_C_cache_ops", "swap_blocks_batch"),
    )
    if not compiled:
        return facts
    if hip_version:
        library = native.find_loaded_library("libamdhip64")
        runtime = native.RuntimeLibrary.load("hip", library) if library else None
        return facts.replace(
            runtime_library=library,
            hip_runtime_version=runtime.version() if runtime else None,
        )
    return facts.replace(
        runtime_library=native.find_loaded_library("libcudart"),
        driver_version=native.cuda_driver_version(),
    )
