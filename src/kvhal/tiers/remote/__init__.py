"""The remote tier: a store every engine of a fleet shares.

:mod:`~kvhal.tiers.remote.tier` (the tier) names, frames and verifies values
and runs the store's calls on its own threads; :mod:`~kvhal.tiers.remote.format`
is the value header; :mod:`~kvhal.tiers.remote.store` the contract a store
implements (the built-in ones are in :mod:`kvhal.tiers.stores`).
"""
