"""The remote-store contract: a key-value store that a fleet of engines shares.

It sits at the contract level beside :mod:`kvhal.tiers.backend` and depends on
nothing else in kvhal. Where a :class:`~kvhal.tiers.backend.TierBackend` is a
medium of slots that one engine owns and indexes, a remote store is shared:
no engine can index it, so kvhal asks it whether keys exist, and every value
names what it holds. The built-in stores are ``mooncake`` (Mooncake Store),
``redis`` and ``s3`` (:mod:`kvhal.tiers.stores`); a plugin offers more through the
``kvhal_remote_stores`` hook, keyed by the URL scheme it serves.

A store only moves bytes. kvhal's :class:`~kvhal.tiers.remote.tier.RemoteTier` does
the rest, once for every store: it names values (a namespace per KV
fingerprint and tensor-parallel rank), frames them with a header that carries
a checksum and, with a shared secret, an HMAC, verifies what comes back,
runs the calls on its own threads with timeouts, and tracks whether the
store is reachable. So a store's methods are plain blocking batch calls.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence

#: :meth:`RemoteStore.get` result for a name the store does not hold.
ABSENT = -1
#: :meth:`RemoteStore.get` result for a name the store could not deliver
#: (the value does not fit the buffers, or that one transfer failed).
FAILED = -2


class StoreUnavailable(Exception):
    """The store cannot be reached (connection refused or lost, master down, timeout).

    Raised by any :class:`RemoteStore` method, and by a factory at connect time.
    kvhal marks the tier down (a miss for every lookup, stores dropped), logs it
    once, and marks it up again at the first call that succeeds.
    """


class RemoteStore(abc.ABC):
    """A connected client of a shared key-value store.

    kvhal calls its methods from its own worker threads, at most
    :attr:`concurrency` at a time; each call blocks until the store answered.
    Names are ASCII strings of at most 250 characters. A value is written as
    the concatenation of its parts and read back scattered over the parts of
    its buffers, in order; both are ``memoryview`` s of plain bytes.
    """

    #: how many calls kvhal may run at once on this client
    concurrency: int = 1
    #: each name :meth:`exist` is asked costs a request of its own (an object store's
    #: ``HEAD``): a lookup then asks a few names of its run of blocks and searches for where
    #: the held part ends (:mod:`kvhal.tiers.remote.run_search`), instead of asking every name
    sparse_exist: bool = False

    def register(self, memory: memoryview) -> None:  # noqa: B027 - optional: most stores copy
        """A hint: later buffers may lie in ``memory`` (the host tier, header rows)
        for the whole life of the client. A zero-copy store registers it; others ignore it."""

    @abc.abstractmethod
    def exist(self, names: Sequence[str]) -> list[bool]:
        """Whether the store holds each of ``names``.

        :raises StoreUnavailable: the store did not answer.
        """

    @abc.abstractmethod
    def put(self, names: Sequence[str], values: Sequence[Sequence[memoryview]]) -> list[bool]:
        """Store ``values[i]`` (its parts, concatenated) under ``names[i]``.

        :return: per name, True once the value is stored, or was stored already
            (names are content-addressed: an existing value is never replaced);
            False if this one put failed (no space, a transfer error).
        :raises StoreUnavailable: the store did not answer.
        """

    def replace(
        self, names: Sequence[str], values: Sequence[Sequence[memoryview]], refused: Sequence[str]
    ) -> list[bool]:
        """Store ``values[i]`` under ``names[i]``, which held a value kvhal refused (a plant, a
        torn write, another secret's): in its place where the name holds nothing, a value
        whose length is not the new value's (never a genuine one), or a value whose SHA-1
        (hex) is ``refused[i]`` (``""``: none known), as one step; else it is left as it is.

        The default, for a store that cannot replace, is :meth:`put` (the name stays taken).

        :return: per name, True once the value is stored, or the name holds another value
            of the right length (another engine's, stored meanwhile); False if it failed.
        :raises StoreUnavailable: the store did not answer.
        """
        return self.put(names, values)

    @abc.abstractmethod
    def get(self, names: Sequence[str], buffers: Sequence[Sequence[memoryview]]) -> list[int]:
        """Read the value of ``names[i]`` into ``buffers[i]`` (its parts, in order).

        :return: per name, the bytes delivered (the value's length), or
            :data:`ABSENT`, or :data:`FAILED` (e.g. a value longer than its
            buffers). Buffers of names not delivered hold undefined bytes.
        :raises StoreUnavailable: the store did not answer.
        """

    def run_blocks(self, value_bytes: int) -> int:
        """How many blocks of a request to store as one value (a run,
        :mod:`kvhal.tiers.remote.runs`) where one block's value is ``value_bytes``: more than
        1 for a store whose every request costs more than its bytes (an object store), which
        then implements :meth:`get_ranges`. The default, 1: every block its own value."""
        return 1

    def get_ranges(
        self, names: Sequence[str], starts: Sequence[int], buffers: Sequence[Sequence[memoryview]]
    ) -> list[int]:
        """:meth:`get`, reading each value from byte ``starts[i]`` on (the tail of a run): the
        bytes delivered from there, :data:`ABSENT` or :data:`FAILED` (a value that does not end
        where its buffers do, or that ends before ``starts[i]``).

        :raises StoreUnavailable: the store did not answer.
        """
        raise NotImplementedError(f"{type(self).__name__} stores no runs (run_blocks is 1)")

    def close(self) -> None:  # noqa: B027 - a store without resources needs nothing here
        """Disconnect (idempotent)."""


#: ``factory(url)`` connects to the store ``url`` names; it raises
#: :class:`~kvhal.errors.ValidationError` for a malformed URL or option (naming
#: it) and :class:`StoreUnavailable` if the store cannot be reached.
StoreFactory = Callable[[str], RemoteStore]
