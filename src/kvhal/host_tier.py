"""The old path of :mod:`kvhal.offload.host_tier`, kept so that code written against it keeps working.

Nothing in kvhal imports it (the layers contract in pyproject.toml leaves it out).
"""

from kvhal.offload.host_tier import HostTier, SlotPool

__all__ = ["HostTier", "SlotPool"]
