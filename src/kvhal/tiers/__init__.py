"""The tier layer: everything below the host tier, as one chain.

A block's way down, once the offloading core (:mod:`kvhal.offload`) has
stored it in a host slot:

1. :mod:`kvhal.tiers.chain` plans the cascade: with each host store
   (write-through) or at each host eviction (write-back), a write to the tier
   below; :mod:`kvhal.tiers.index` keeps that tier's key -> slot index and
   picks its victims.
2. :mod:`kvhal.tiers.io` moves the bytes, on the worker, from the host slot to
   a :mod:`kvhal.tiers.backend` (the tier contract): the built-in
   :mod:`kvhal.tiers.disk`, or a plugin's.
3. :mod:`kvhal.tiers.remote` writes the block to a store the fleet shares:
   :mod:`kvhal.tiers.remote.tier` names and frames the value
   (:mod:`kvhal.tiers.remote.format`) and hands it to a
   :mod:`kvhal.tiers.remote.store` (the store contract):
   :mod:`kvhal.tiers.stores.redis`, :mod:`kvhal.tiers.stores.mooncake`,
   :mod:`kvhal.tiers.stores.s3`, or a plugin's.

And its way up, when a request's prefix is not in host memory:

1. Lookup: :class:`~kvhal.tiers.chain.TierChain` finds the host tier's prefix,
   then how far the index of the tier below continues it; the remote tier is
   asked (``exist``) for what follows.
2. Promotion: a hit found below takes fresh host slots
   (:meth:`~kvhal.tiers.chain.TierChain.prepare_load`).
3. Fetch: the worker reads the blocks into those slots (:mod:`kvhal.tiers.io`,
   or the remote tier's ``get``), and loads them into the device as any host hit.

:mod:`kvhal.tiers.media` opens a tier backend by name and a store by URL
scheme, through the ``kvhal_tier_backends`` and ``kvhal_remote_stores`` hooks.
"""
