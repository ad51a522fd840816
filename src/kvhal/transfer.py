"""The old path of :mod:`kvhal.offload.transfer`, kept so that code written against it keeps working.

Nothing in kvhal imports it (the layers contract in pyproject.toml leaves it out).
"""

from kvhal.offload.transfer import TransferEngine, TransferKind, TransferResult

__all__ = ["TransferEngine", "TransferKind", "TransferResult"]
