"""The built-in disk tier: :mod:`~kvhal.tiers.disk.tier` (the backend),
:mod:`~kvhal.tiers.disk.batches` (a call's checks and its tasks on the I/O threads),
:mod:`~kvhal.tiers.disk.recovery` (the index read back at start),
:mod:`~kvhal.tiers.disk.directory` (options, files, lock),
:mod:`~kvhal.tiers.disk.namespaces` (one directory per model, sized),
:mod:`~kvhal.tiers.disk.ranks` (each rank's directory checked or made),
:mod:`~kvhal.tiers.disk.format` (its files and records) and
:mod:`~kvhal.tiers.disk.io` (aligned, direct I/O)."""

from kvhal.tiers.disk.tier import DiskTier

__all__ = ["DiskTier"]
