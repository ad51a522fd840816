"""The old path of :mod:`kvhal.offload.offloader`, kept so that code written against it keeps working.

Nothing in kvhal imports it (the layers contract in pyproject.toml leaves it out).
"""

from kvhal.offload.offloader import Offloader, StoreJob

__all__ = ["Offloader", "StoreJob"]
