"""kvhal-rocm: the kvhal device plugin for AMD GPUs (HIP through torch.cuda).

ROCm builds of torch reuse the ``torch.cuda`` API (device type ``"cuda"``), so
this plugin builds on kvhal-cuda's shared GPU plugin and differs in its
probe, its layout table and its copy-engine choice.
"""

from kvhal_rocm.plugin import ROCmPlugin

__all__ = ["ROCmPlugin"]
