"""Building blocks for plugins of accelerators that torch drives through streams and events.

Nothing here names a vendor: a plugin passes in its stream module
(``torch.cuda``, ``torch.npu``) and its copy calls. What lives here:

- :mod:`kvhal.accel.descriptors`: a plan's byte descriptors, cut into
  batches of bounded count or split by size;
- :mod:`kvhal.accel.events`: events that report a failed copy as
  :class:`~kvhal.errors.TransferError`;
- :mod:`kvhal.accel.streams`: the seven stream and event hooks over a torch
  stream module;
- :mod:`kvhal.accel.host_writes`: which host bytes device copies may still be
  writing, so that a load may let its source be read out of stream order only
  when nothing can change it;
- :mod:`kvhal.accel.torch_copy`: a plan executed with ``Tensor.copy_`` over
  byte views, the fallback that works on every torch device;
- :mod:`kvhal.accel.engines`: an ordered chain of copy engines that falls back
  to the next one while an engine has never worked;
- :mod:`kvhal.accel.copies`: ``kvhal_copy_blocks`` over such a chain;
- :mod:`kvhal.accel.plugin_base`: the plugin outline (machine facts, stream
  module, the probe's steps) a torch-driven accelerator plugin fills in;
- :mod:`kvhal.accel.host_buffers`: the host-buffer hooks, the page size,
  page-aligned anonymous memory to register, ``KVHAL_PIN_HOST``;
- :mod:`kvhal.accel.native`: loading a vendor runtime and binding its calls with ctypes.

A CPU stand-in for a torch stream module, to test a plugin without its device, is
:mod:`kvhal.testing.accel`.
"""
