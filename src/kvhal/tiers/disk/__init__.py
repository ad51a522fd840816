"""The built-in disk tier: :mod:`~kvhal.tiers.disk.tier` (the backend),
:mod:`~kvhal.tiers.disk.format` (its files and records) and
:mod:`~kvhal.tiers.disk.io` (aligned, direct I/O)."""

from kvhal.tiers.disk.tier import DiskTier

__all__ = ["DiskTier"]
