"""kvhal-npu: the kvhal device plugin for Huawei Ascend NPUs (torch_npu).

Importing this package does not import torch_npu: the probe does, and
declines with a reason when it is not installed (``pip install kvhal-npu[npu]``).
"""

from kvhal_npu.plugin import NPUPlugin

__all__ = ["NPUPlugin"]
