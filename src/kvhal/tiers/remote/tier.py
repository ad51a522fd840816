"""A shared store as kvhal's remote tier: names, framing, threads, health.

One class for every store (:mod:`kvhal.tiers.remote.store` is what a store
implements). It is opened once by the scheduler (``role="index"``: existence
checks, over every tensor-parallel rank's share) and once per worker
(``role="io"``: that rank's reads and writes, between the worker's host-tier
slots and the store). Every call returns a future at once and runs on the
tier's threads: the engine never waits on the network.

Names are ``PREFIX/vVERSION/NAMESPACE/KEY`` (the value format's version, then the
namespace, :func:`~kvhal.tiers.remote.format.name_prefix`): the namespace digests the KV fingerprint
(model and revision, dtype, layout and geometry, groups, hash algorithm and
seed, tensor-parallel size) and the rank, so engines of another model or
geometry sharing the store never read each other's blocks. Each value is a
:mod:`~kvhal.tiers.remote.format` header and the block's bytes, verified on every
read (a failure is a miss, counted by its kind).

A refused value does not keep its name: the tier remembers the names it refused
(and the SHA-1 of what it read there) and writes the engine's recomputed block
there with the store's :meth:`~kvhal.tiers.remote.store.RemoteStore.replace`,
which never replaces a value it was not shown to be refused.

Where the store says a block's value is smaller than its requests are worth
(:meth:`~kvhal.tiers.remote.store.RemoteStore.run_blocks`: an object store), runs of a
request's blocks are stored as one value each (:mod:`~kvhal.tiers.remote.runs`): the
calls then take each key's block position in its request.

A store that cannot be reached marks the tier *down*: calls fail fast (the
engine recomputes; stores are dropped) and the tier tries to connect again
at most every ``retry_seconds``; the first call that succeeds marks it *up*.
Each change is reported once through ``on_health``.
"""

from __future__ import annotations

import hashlib
import mmap
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TypeVar

import numpy as np

from kvhal.errors import TierError
from kvhal.offload.host_tier import HostTier
from kvhal.registry import PluginRegistry
from kvhal.threads import kernel_name, named_pool
from kvhal.tiers.backend import CORRUPT, FOREIGN, IO_ERROR, MISSING, OK, ReadOutcome, TierSpec
from kvhal.tiers.media import open_store
from kvhal.tiers.remote import format as remote_format
from kvhal.tiers.remote.run_search import held_prefix
from kvhal.tiers.remote.runs import MAX_RUN_BLOCKS, Piece, held_blocks, pieces
from kvhal.tiers.remote.store import ABSENT, RemoteStore, StoreUnavailable
from kvhal.tiers.remote.urls import redact

T = TypeVar("T")
HEADER_BYTES = remote_format.HEADER_BYTES
#: Most threads a tier runs its store calls on (the store's ``concurrency`` caps it further).
MAX_THREADS = 4
#: Most refused names a tier remembers to write again (the oldest forgotten first).
REFUSED_NAMES = 4096
#: Lookups whose time :attr:`RemoteTier.expected_lookup_s` is the median of.
LOOKUPS_KEPT = 16
#: Outcomes of a value that is there but refused: its name is written again, replacing it.
_REFUSED = (CORRUPT, FOREIGN, remote_format.UNAUTHENTICATED)


def _sha1(*parts: memoryview) -> str:
    digest = hashlib.sha1(usedforsecurity=False)
    for part in parts:
        digest.update(part)
    return digest.hexdigest()


def _aligned(rows: int, row_bytes: int) -> np.ndarray:
    memory = mmap.mmap(-1, max(rows * row_bytes, 1))
    return np.frombuffer(memory, dtype=np.uint8, count=rows * row_bytes).reshape(rows, row_bytes)


class RemoteTier:
    """A shared store behind the host tier.

    :param url: the store's URL (its scheme picks the store plugin).
    :param spec: what the KV is (``slot_bytes``, ``fingerprint``, ``rank``,
        ``world_size``; ``options`` unused) and the ``role``.
    :param host: the worker's host tier (``role="io"``): values move between
        its slots and the store, in place where a slot is one run of bytes.
    :param secret: values carry an HMAC of it, and values without a valid one are refused.
    :param previous_secrets: values with an HMAC of one of these are accepted too (a rotation).
    :param on_previous_secret: called with how many values a read accepted by a previous secret.
    :param strict: a store unreachable now is a :class:`~kvhal.errors.TierError`
        instead of a tier that starts down.
    :param on_health: called with ``(up, why)`` each time the store's reachability changes.
    :param runs: store runs of blocks as one value where the store asks for it (a model whose
        blocks come in one group; the positions of a hybrid model's groups interleave).
    :raises ValidationError: a malformed URL (from the store's factory).
    :raises TierError: ``strict`` and the store is unreachable.
    """

    def __init__(
        self,
        url: str,
        spec: TierSpec,
        *,
        host: HostTier | None = None,
        secret: bytes | None = None,
        previous_secrets: Sequence[bytes] = (),
        on_previous_secret: Callable[[int], None] | None = None,
        strict: bool = False,
        registry: PluginRegistry | None = None,
        on_health: Callable[[bool, str], None] | None = None,
        retry_seconds: float = 2.0,
        prefix: str = "kvhal",
        runs: bool = True,
    ) -> None:
        self.url, self.spec, self.host, self.secret = url, spec, host, secret or None
        self.previous_secrets = tuple(p for p in previous_secrets if p) if self.secret else ()
        self.on_previous_secret = on_previous_secret or (lambda count: None)
        # names whose value this tier refused -> that value's SHA-1 ("": not read whole)
        self._refused: OrderedDict[str, str] = OrderedDict()
        self._lookup_seconds: deque[float] = deque(maxlen=LOOKUPS_KEPT)
        self.registry = registry or PluginRegistry()
        self.on_health = on_health or (lambda up, why: None)
        self.retry_seconds = retry_seconds
        self._prefixes = [remote_format.name_prefix(prefix, spec.digest(r)) for r in range(spec.world_size)]
        self._namespace = spec.digest()
        self._runs = runs
        self.run_blocks = 1  # blocks per value: the store's choice, known once connected
        self._lock = threading.Lock()
        self._store: RemoteStore | None = None
        self._last_try = 0.0
        self.up = False
        self._reported: bool | None = None  # the reachability last reported
        self._closed = False
        # header rows: one per host slot (a slot is read or written by one call at a time)
        self._headers = _aligned(host.num_slots if host else 1, HEADER_BYTES)
        try:
            self._connect()
        except StoreUnavailable as exc:
            if strict:
                raise TierError(
                    "remote",
                    redact(url),
                    f"the store cannot be reached ({exc}); remote_strict is set, so the engine "
                    "does not start without it",
                ) from exc
            self._set_health(False, str(exc))
        concurrency = self._store.concurrency if self._store else MAX_THREADS
        self._threads = named_pool(max(1, min(concurrency, MAX_THREADS)), "kvhal-remote")

    # -- connection and health ----------------------------------------------------

    def _connect(self) -> RemoteStore:
        self._last_try = time.monotonic()
        with kernel_name("kvhal-store"):  # the client's native threads, named for what they do
            store = open_store(self.url, self.registry)
            if self._runs:
                asked = store.run_blocks(HEADER_BYTES + self.spec.slot_bytes)
                self.run_blocks = max(1, min(int(asked), MAX_RUN_BLOCKS))
            store.register(memoryview(self._headers.reshape(-1)))
            if self.host is not None and self.host.slots_are_contiguous:
                store.register(self.host.memory())
        self._store = store
        self._set_health(True, "connected")
        return store

    def _set_health(self, up: bool, why: str) -> None:
        with self._lock:
            changed = up != self._reported
            self.up = self._reported = up
        if changed:
            self.on_health(up, why)

    def _client(self) -> RemoteStore:
        """The connected store; reconnects at most every ``retry_seconds`` while there is none."""
        if self._closed:
            raise StoreUnavailable("the remote tier is closed")
        store = self._store
        if store is not None:
            return store
        with self._lock:
            due = time.monotonic() - self._last_try >= self.retry_seconds
            if due:
                self._last_try = time.monotonic()
        if not due:
            raise StoreUnavailable("not connected (retrying)")
        return self._connect()

    def _run(self, call: Callable[[RemoteStore], T]) -> T:
        try:
            store = self._client()
            try:
                result = call(store)
            except StoreUnavailable:
                if not self.up:
                    raise
                # A client idle while its store restarted fails its first call on a stale
                # connection (Mooncake's does): one more try tells that from an outage.
                result = call(store)
        except StoreUnavailable as exc:
            self._set_health(False, str(exc))
            raise
        if not self.up:
            self._set_health(True, "answering again")
        return result

    # -- names ----------------------------------------------------------------------

    def names(self, keys: Sequence[bytes], rank: int | None = None) -> list[str]:
        """The store's names of ``keys`` for ``rank`` (default: this spec's)."""
        prefix = self._prefixes[self.spec.rank if rank is None else rank]
        return [prefix + key.hex() for key in keys]

    def _run_name(self, key: bytes, rank: int | None = None) -> str:
        """The name of the run of :attr:`run_blocks` blocks that ends with block ``key``."""
        prefix = self._prefixes[self.spec.rank if rank is None else rank]
        return f"{prefix}r{self.run_blocks}-{key.hex()}"

    def _object(self, keys: list[bytes], names: list[str], part: Piece) -> str:
        """The name of the value ``part`` of a call moves: its run's, or its one block's."""
        return self._run_name(keys[part.indices[-1]]) if part.run else names[part.indices[0]]

    def _pieces(self, positions: Sequence[int] | None, count: int, tails: bool) -> list[Piece]:
        if positions is not None and len(positions) != count:
            raise ValueError(f"{len(positions)} positions for {count} keys")
        return pieces(positions if positions is not None else [-1] * count, self.run_blocks, tails=tails)

    # -- the scheduler's calls --------------------------------------------------------

    def exist(self, keys: Sequence[bytes]) -> Future[list[bool]]:
        """Whether the store holds every rank's share of each of ``keys``.

        The future raises :class:`StoreUnavailable` if the store did not answer.
        """
        keys = list(keys)
        ranks = range(self.spec.world_size)
        names = [name for rank in ranks for name in self.names(keys, rank)]

        def call(store: RemoteStore) -> list[bool]:
            found = store.exist(names)
            n = len(keys)
            return [all(found[rank * n + i] for rank in ranks) for i in range(n)]

        return self._threads.submit(self._run, call)

    def exist_run(self, keys: Sequence[bytes], positions: Sequence[int] | None = None) -> Future[list[bool]]:
        """:meth:`exist` for a run of blocks' keys in order (a lookup's, after its local hit),
        of which only a held prefix counts. Where the store asks a request per name
        (``sparse_exist``), the answer is that prefix, found from a few names
        (:mod:`~kvhal.tiers.remote.run_search`): a key it takes as held may be a hole, whose
        read then fails (recomputed, written again). With runs (``positions``: each key's block
        in its request), a run's name answers for its blocks
        (:func:`~kvhal.tiers.remote.runs.held_blocks`). How long each took is kept
        (:attr:`expected_lookup_s`)."""
        keys = list(keys)
        ranks = range(self.spec.world_size)
        asked_at = time.monotonic()
        store = self._store
        if store is None or not store.sparse_exist:
            future = self.exist(keys)
        else:
            parts = self._pieces(positions, len(keys), tails=True)  # (a store asked by name only)

            def ask(store: RemoteStore, indices: list[int]) -> list[bool]:
                asked = [keys[i] for i in indices]
                found = store.exist([name for rank in ranks for name in self.names(asked, rank)])
                n = len(asked)
                return [all(found[rank * n + i] for rank in ranks) for i in range(n)]

            def exists(store: RemoteStore, units: list[tuple[bool, int]]) -> list[bool]:
                names = [
                    self._run_name(keys[i], rank) if run else self.names([keys[i]], rank)[0]
                    for rank in ranks
                    for run, i in units
                ]
                found, n = store.exist(names), len(units)
                return [all(found[rank * n + u] for rank in ranks) for u in range(n)]

            def call(store: RemoteStore) -> list[bool]:
                if any(part.run for part in parts):
                    held = held_blocks(len(keys), parts, lambda units: exists(store, units))
                else:
                    held = held_prefix(len(keys), lambda indices: ask(store, indices))
                return [True] * held + [False] * (len(keys) - held)

            future = self._threads.submit(self._run, call)

        def timed(done: Future[list[bool]]) -> None:
            if not done.cancelled() and done.exception() is None:
                self._lookup_seconds.append(time.monotonic() - asked_at)

        future.add_done_callback(timed)
        return future

    @property
    def expected_lookup_s(self) -> float | None:
        """The median time of the last :data:`LOOKUPS_KEPT` lookups (:meth:`exist_run`) that
        were answered, from asking to the answer; ``None`` before the first."""
        seconds = sorted(self._lookup_seconds)
        return seconds[len(seconds) // 2] if seconds else None

    # -- the workers' calls -------------------------------------------------------------

    def _payloads(self, slots: Sequence[int]) -> tuple[list[memoryview], np.ndarray | None]:
        assert self.host is not None, "reads and writes need the worker's host tier (role io)"
        if self.host.slots_are_contiguous:
            return [self.host.slot_memory(slot) for slot in slots], None
        rows = _aligned(len(slots), self.host.slot_bytes)
        return [memoryview(row) for row in rows], rows

    def write(
        self, keys: Sequence[bytes], host_slots: Sequence[int], positions: Sequence[int] | None = None
    ) -> Future[list[bool]]:
        """Store host slots ``host_slots`` as ``keys``; one bool per key (False: not stored).
        With ``positions`` (each key's block in its request), the runs the keys hold whole
        are stored as one value each (:mod:`~kvhal.tiers.remote.runs`).

        The slots must stay unchanged until the future completes. It never
        raises: an unreachable store makes every result False.
        """
        keys, host_slots = list(keys), list(host_slots)
        names = self.names(keys)
        parts = self._pieces(positions, len(keys), tails=False)

        def work() -> list[bool]:
            payloads, rows = self._payloads(host_slots)
            if rows is not None:
                assert self.host is not None
                self.host.gather_slots(host_slots, rows)
            headers = [memoryview(self._headers[slot]) for slot in host_slots]
            for header, payload, name in zip(headers, payloads, names, strict=True):
                remote_format.write_header(header, payload, self._namespace, name, self.secret)
            # a value per piece: a block's header and bytes, or a run's blocks', one after another
            objects = [self._object(keys, names, p) for p in parts]
            values = [tuple(view for i in p.indices for view in (headers[i], payloads[i])) for p in parts]
            with self._lock:
                refused = {i: self._refused[n] for i, n in enumerate(objects) if n in self._refused}
            try:
                stored = self._run(lambda store: self._put(store, objects, values, refused))
            except StoreUnavailable:
                return [False] * len(keys)
            with self._lock:
                for i in refused:
                    if stored[i]:
                        self._refused.pop(objects[i], None)
            results = [False] * len(keys)
            for part, ok in zip(parts, stored, strict=True):
                for i in part.indices:
                    results[i] = ok
            return results

        return self._threads.submit(work)

    @staticmethod
    def _put(
        store: RemoteStore,
        names: list[str],
        values: list[tuple[memoryview, ...]],
        refused: dict[int, str],
    ) -> list[bool]:
        """Put ``values``; those of ``refused`` names (index -> SHA-1) replace what was refused."""
        if not refused:
            return store.put(names, values)
        fresh = [i for i in range(len(names)) if i not in refused]
        results = [False] * len(names)
        if fresh:
            for i, ok in zip(
                fresh, store.put([names[i] for i in fresh], [values[i] for i in fresh]), strict=True
            ):
                results[i] = ok
        replaced = store.replace(
            [names[i] for i in refused], [values[i] for i in refused], list(refused.values())
        )
        for i, ok in zip(refused, replaced, strict=True):
            results[i] = ok
        return results

    def _remember_refused(self, name: str, digest: str) -> None:
        with self._lock:
            self._refused[name] = digest
            self._refused.move_to_end(name)
            while len(self._refused) > REFUSED_NAMES:
                self._refused.popitem(last=False)

    def read(
        self, keys: Sequence[bytes], host_slots: Sequence[int], positions: Sequence[int] | None = None
    ) -> Future[list[ReadOutcome]]:
        """Read ``keys`` into host slots ``host_slots``: one outcome per key, :data:`OK` once
        its bytes are in its slot and verified (else ``missing``, ``corrupt``, ``foreign``,
        ``unauthenticated`` or ``io_error``, and the slot's bytes are undefined). With
        ``positions`` (each key's block in its request), a run's blocks are read from the
        run's value, one ranged read each, and alone where the run is not there.

        It never raises: an unreachable store makes every outcome ``io_error``.
        """
        keys, host_slots = list(keys), list(host_slots)
        names = self.names(keys)
        parts = self._pieces(positions, len(keys), tails=True)
        block = HEADER_BYTES + (self.host.slot_bytes if self.host else 0)

        def work() -> list[ReadOutcome]:
            payloads, rows = self._payloads(host_slots)
            headers = [memoryview(self._headers[slot]) for slot in host_slots]
            outcomes: list[ReadOutcome] = [IO_ERROR] * len(keys)
            previous = 0

            def fetch(batch: list[Piece]) -> list[Piece]:
                """Read ``batch`` and judge its blocks; the runs that were not there."""
                nonlocal previous
                objects = [self._object(keys, names, p) for p in batch]
                starts = [p.skip * block for p in batch]
                buffers = [[view for i in p.indices for view in (headers[i], payloads[i])] for p in batch]
                if self.run_blocks > 1:
                    sizes = self._run(lambda store: store.get_ranges(objects, starts, buffers))
                else:
                    sizes = self._run(lambda store: store.get(objects, buffers))
                absent = []
                for part, name, size, parts_read in zip(batch, objects, sizes, buffers, strict=True):
                    if part.run and size == ABSENT:
                        absent.extend(Piece(range(i, i + 1), False) for i in part.indices)
                        continue
                    for j, i in enumerate(part.indices):  # each block as much as reached it
                        got = size if size < 0 else max(0, min(block, size - j * block))
                        outcomes[i], signer = self._judge(got, headers[i], payloads[i], names[i])
                        previous += signer > 0
                    whole = size == len(part.indices) * block
                    if any(outcomes[i] in _REFUSED for i in part.indices) or (size != ABSENT and not whole):
                        # written again over it: where its digest is known, only over what was read
                        self._remember_refused(name, _sha1(*parts_read) if whole and part.skip == 0 else "")
                return absent

            try:
                absent = fetch(parts)
                if absent:  # runs not stored as runs: their blocks alone
                    fetch(absent)
            except StoreUnavailable:
                return [IO_ERROR] * len(keys)
            if previous:
                self.on_previous_secret(previous)
            if rows is not None:
                assert self.host is not None
                good = [i for i, outcome in enumerate(outcomes) if outcome is OK]
                if good:
                    self.host.scatter_slots([host_slots[i] for i in good], rows[good])
            return outcomes

        return self._threads.submit(work)

    def _judge(
        self, size: int, header: memoryview, payload: memoryview, name: str
    ) -> tuple[ReadOutcome, int]:
        """One block's outcome from the bytes its read delivered, and which secret signed it."""
        if size == ABSENT:
            return MISSING, 0
        if size != HEADER_BYTES + payload.nbytes:
            return (CORRUPT if size >= 0 else IO_ERROR), 0
        return remote_format.signed_by(
            header, payload, self._namespace, name, self.secret, self.previous_secrets
        )

    def close(self) -> None:
        """Finish the calls in flight, then disconnect (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._threads.shutdown(wait=True)
        if self._store is not None:
            self._store.close()
            self._store = None
