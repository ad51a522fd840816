"""The old path of :mod:`kvhal.offload.manager`, kept so that code written against it keeps working.

Nothing in kvhal imports it (the layers contract in pyproject.toml leaves it out).
"""

from kvhal.offload.manager import STORING, BlockState, OffloadEvent, OffloadingManager, StorePlan

__all__ = ["STORING", "BlockState", "OffloadEvent", "OffloadingManager", "StorePlan"]
