"""The old path of :mod:`kvhal.tiers.remote.store`, kept so that code written against it keeps working.

Nothing in kvhal imports it (the layers contract in pyproject.toml leaves it out).
"""

from kvhal.tiers.remote.store import ABSENT, FAILED, RemoteStore, StoreFactory, StoreUnavailable

__all__ = ["ABSENT", "FAILED", "RemoteStore", "StoreFactory", "StoreUnavailable"]
