"""The built-in remote stores: :mod:`~kvhal.tiers.stores.redis`,
:mod:`~kvhal.tiers.stores.mooncake` and :mod:`~kvhal.tiers.stores.s3`, each a
:class:`~kvhal.tiers.remote.store.RemoteStore`.

They are opened by URL scheme through :func:`kvhal.tiers.media.open_store`;
importing this package loads neither client library.
"""
