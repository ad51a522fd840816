"""kvhal-cuda: the kvhal device plugin for NVIDIA GPUs (torch.cuda).

Importing this package imports nothing but torch and kvhal; the CUDA driver
and runtime are reached through ctypes only when the plugin probes or copies.
kvhal-rocm builds on the same torch.cuda machinery (:mod:`kvhal_cuda.gpu`).
"""

from kvhal_cuda.plugin import CUDAPlugin

__all__ = ["CUDAPlugin"]
