"""Mooncake Store as the shared remote store: zero-copy batch puts and gets through its client.

The URL (``remote_url``) and its options: :mod:`kvhal.tiers.stores.mooncake_url`.

A fleet needs a master (``mooncake_master --enable_http_metadata_server=true``) and store nodes
(``mooncake_client --global_segment_size=...``) that hold the values: a value lives in the
memory of the process that contributed the segment it was put in, so it disappears with that
process. Engines come and go, so their clients use ``segment=0`` (the default) and the cache
survives in the store nodes; an engine may still contribute memory with ``segment=``, for
values that may vanish with it.

Zero-copy: :meth:`MooncakeStore.register` registers memory with Mooncake's transfer engine
(kvhal registers its host tier and header rows), and a put or get moves the bytes of parts
lying in registered memory directly (RDMA or TCP) between them and the store nodes. A part
outside every registered range is copied through a registered staging area of this client:
RDMA can only reach registered memory, and registering the caller's buffer for the call is
not an option because Mooncake refuses a region overlapping one already registered (rc -600),
which two concurrent calls over the same buffer would hit. (The TCP transport would accept
unregistered memory; kvhal does not rely on it.) The parts of a value of at most
``COALESCE_BYTES`` (1 MiB: kvhal's header and a small block) are staged together too, so that
the value moves as one slice: Mooncake's TCP transport pays per slice about as much as for a
small block (BENCHMARKS.md, "Shared tier").

Mooncake's return codes (``ErrorCode`` in ``mooncake-store/include/types.h``) are mapped:
``OBJECT_NOT_FOUND`` (-704) and ``REPLICA_IS_NOT_READY`` (-703, a put still in flight) read
as absent; ``OBJECT_ALREADY_EXISTS`` (-705, reported as 0 by the client) as stored;
``RPC_FAIL`` (-900), ``RPC_TIMEOUT`` (-901) and ``UNAVAILABLE_IN_CURRENT_STATUS`` (-1010)
for every name of a call raise :class:`~kvhal.tiers.remote.store.StoreUnavailable`; any other
negative code fails that name alone (e.g. ``NO_AVAILABLE_HANDLE`` -200, no space; or
``INVALID_PARAMS`` -600, a value larger than its buffers, refused before any byte moves).
``exist`` raises StoreUnavailable for any negative answer. Mooncake's transfer needs the buffers
to add up to the value's size exactly (else ``TRANSFER_FAIL`` -800), so a value shorter than
its buffers is read again, after asking its size, into their first bytes.

Timeouts are the library's own: with the master down, ``exist`` fails at once but a put or a
get blocks about 4.3 s before it fails, and connecting (``from_url``) retries 20 times, about
90 s, so ``from_url`` first checks that the master's and the metadata server's ports accept a
TCP connection (3 s at most each). The client reconnects by itself once the master is back
(the master keeps no state across a restart: the names it held are gone). Closing takes about
a second (Mooncake's teardown); a closed client answers StoreUnavailable.

A value kvhal refused is replaced (:meth:`MooncakeStore.replace`) by reading it again, and only
if it is still the one refused (or not of a block's length), putting the new one with its
``upsert`` (``remove`` is refused for a value read in the last seconds: its lease). Mooncake has
no compare-and-set, so this is not one step: where another engine replaced the refused value
between this check and the upsert, its value is overwritten by this one, the same block signed
with the same secret; a value this engine would refuse is never put.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import socket
import threading
from collections.abc import Iterator, Sequence
from typing import Any
from urllib.parse import urlsplit

from kvhal.errors import ValidationError
from kvhal.tiers.remote.store import ABSENT, FAILED, RemoteStore, StoreUnavailable
from kvhal.tiers.stores.mooncake_staging import MIN_STAGING, Plan, Staging, as_bytes
from kvhal.tiers.stores.mooncake_url import ARGUMENT, MooncakeOptions, host_port, parse_url, route_address

__all__ = ["MooncakeStore"]

log = logging.getLogger(__name__)

#: seconds a TCP probe of the master's and the metadata server's ports may take
PROBE_TIMEOUT = 3.0
#: how many calls kvhal may run at once on one client (see MooncakeStore.concurrency)
CONCURRENCY = 4

# Mooncake's ErrorCode values (mooncake-store/include/types.h)
OBJECT_NOT_FOUND = -704
REPLICA_IS_NOT_READY = -703
OBJECT_ALREADY_EXISTS = -705
TRANSFER_FAIL = -800
#: codes meaning the master did not answer (RPC_FAIL, RPC_TIMEOUT, UNAVAILABLE_IN_CURRENT_STATUS)
UNAVAILABLE = frozenset({-900, -901, -1010})
NOT_HELD = frozenset({OBJECT_NOT_FOUND, REPLICA_IS_NOT_READY})

MISSING_CLIENT = (
    "mooncake:// needs Mooncake's client: pip install mooncake-transfer-engine-non-cuda "
    "(or mooncake-transfer-engine on GPU machines)"
)


def _load_client() -> tuple[Any, Any]:
    """Mooncake's client classes, imported only when a store connects (it loads a large library)."""
    try:
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig
    except ImportError as exc:
        raise ValidationError(ARGUMENT, MISSING_CLIENT) from exc
    return MooncakeDistributedStore, ReplicateConfig


def _probe(what: str, host: str, port: int, where: str) -> None:
    # Mooncake's setup retries for ~90 s against a dead master; a refused connection fails here at once.
    try:
        socket.create_connection((host, port), timeout=PROBE_TIMEOUT).close()
    except OSError as exc:
        address = host_port(host, port)
        raise StoreUnavailable(f"{where}: cannot connect to the {what} at {address} ({exc})") from exc


class MooncakeStore(RemoteStore):
    """A connected Mooncake Store client (see the module's docstring).

    Build it with :meth:`from_url`. Methods are thread-safe: Mooncake's client releases the
    GIL and guards its state with its own locks, and Mooncake's Python code runs batch puts of
    one client on parallel threads itself (``structured_object_store.py``).
    """

    #: calls kvhal may run at once: the client is thread-safe (see the class docstring)
    concurrency = CONCURRENCY

    def __init__(self, client: Any, replicate_config: Any, options: MooncakeOptions) -> None:
        self._client = client
        self._config = replicate_config
        self.options = options
        self._state = threading.Condition()
        self._calls = 0
        self._closed = False
        self._ranges: list[tuple[int, int]] = []  # registered memory: [start, end)
        self._register_lock = threading.Lock()  # two registrations of one range: Mooncake refuses the second
        self._staging_lock = threading.Lock()
        self._free_staging: list[Staging] = []
        self._all_staging: list[Staging] = []

    @classmethod
    def from_url(cls, url: str) -> MooncakeStore:
        """Connect to the master a ``mooncake://`` URL names.

        :raises ValidationError: (``remote_url``) a malformed URL or option, checked before
            connecting; or Mooncake's client is not installed.
        :raises StoreUnavailable: the master or the metadata server cannot be reached, or
            Mooncake's setup failed.
        """
        options = parse_url(url)
        client_class, config_class = _load_client()
        meta = urlsplit(options.metadata)
        meta_port = meta.port or (443 if meta.scheme == "https" else 80)
        _probe("master", options.host, options.port, options.where)
        _probe("metadata server", meta.hostname or "", meta_port, options.where)
        local_host = options.local_host or route_address(options.host, options.port)
        client = client_class()
        rc = client.setup(
            local_host,
            options.metadata,
            options.segment,
            options.buffer,
            options.protocol,
            options.device,
            options.master,
        )
        if rc != 0:
            with contextlib.suppress(Exception):
                client.close()
            raise StoreUnavailable(f"{options.where}: setup returned {rc}")
        config = config_class()
        config.replica_num = options.replicas
        store = cls(client, config, options)
        if options.segment == 0:
            store._check_something_holds_values()
        return store

    def _check_something_holds_values(self) -> None:
        """Warn once if a test value cannot be stored: with ``segment=0`` this client holds
        nothing, and if no store node does either, every write fails and nothing says so."""
        name = f"kvhal/probe/{socket.gethostname()}-{os.getpid()}-{id(self)}"
        try:  # through Mooncake's own buffer: kvhal's staging areas stay for the blocks
            with self._call() as client:
                rc = int(client.put(name, bytes(64), self._config))
        except Exception:
            return  # an unreachable store is said by the tier as the store being down
        if rc in (0, OBJECT_ALREADY_EXISTS):
            with self._call() as client, contextlib.suppress(Exception):
                client.remove(name)
            return
        log.warning(
            "%s: a 64-byte test value could not be stored: this client contributes no memory "
            "(segment=0) and no store node seems to hold values (start mooncake_client "
            "--global_segment_size=..., or give segment=): every block written will be lost",
            self.options.where,
        )

    def __repr__(self) -> str:
        return f"MooncakeStore({self.options.where}, protocol={self.options.protocol})"

    # -- calls ------------------------------------------------------------------------

    @contextlib.contextmanager
    def _call(self) -> Iterator[Any]:
        # close() waits for the calls in flight: Mooncake's close frees what they use
        with self._state:
            if self._closed:
                raise StoreUnavailable(f"{self.options.where}: this client is closed")
            self._calls += 1
        try:
            yield self._client
        finally:
            with self._state:
                self._calls -= 1
                if not self._calls:
                    self._state.notify_all()

    def _registered(self, start: int, size: int) -> bool:
        end = start + size
        return any(low <= start and end <= high for low, high in self._ranges)

    def register(self, memory: memoryview) -> None:
        """Register ``memory`` with Mooncake's transfer engine for zero-copy puts and gets.

        ``memory`` must stay allocated until :meth:`close`: it stays registered, and freed
        memory handed out again (e.g. as a staging area) would overlap it.
        Memory already inside a registered range is left as it is. If Mooncake refuses it
        (e.g. it overlaps a registered range), a warning is logged and parts in it are copied
        through the staging area.
        """
        view = as_bytes(memory, "memory", writable=False)
        if not view.nbytes:
            return
        start = int(view.ctypes.data)
        with self._call() as client, self._register_lock:
            if self._registered(start, view.nbytes):
                return
            rc = int(client.register_buffer(start, view.nbytes))
            if rc != 0:
                log.warning(
                    "%s: registering %d bytes at %#x failed (rc %d); they will be copied through "
                    "a staging area",
                    self.options.where,
                    view.nbytes,
                    start,
                    rc,
                )
                return
            self._ranges.append((start, start + view.nbytes))

    def exist(self, names: Sequence[str]) -> list[bool]:
        names = list(names)
        if not names:
            return []
        with self._call() as client:
            codes = list(client.batch_is_exist(names))
        if len(codes) != len(names) or any(code < 0 for code in codes):
            bad = sorted({code for code in codes if code < 0}) or [f"{len(codes)} answers"]
            raise StoreUnavailable(f"{self.options.where}: batch_is_exist returned {bad}")
        return [code == 1 for code in codes]

    def put(self, names: Sequence[str], values: Sequence[Sequence[memoryview]]) -> list[bool]:
        names = list(names)
        if len(values) != len(names):
            raise ValidationError("values", f"{len(values)} values for {len(names)} names")
        if not names:
            return []
        with self._call() as client:
            plan = Plan(self, [[as_bytes(p, "values", writable=False) for p in parts] for parts in values])
            try:
                plan.stage_in()
                codes = list(client.batch_put_from_multi_buffers(names, plan.ptrs, plan.sizes, self._config))
            finally:
                plan.release()
        self._check_answered("batch_put_from_multi_buffers", codes, len(names))
        return [code in (0, OBJECT_ALREADY_EXISTS) for code in codes]

    def replace(
        self, names: Sequence[str], values: Sequence[Sequence[memoryview]], refused: Sequence[str]
    ) -> list[bool]:
        if not len(names) == len(values) == len(refused):
            raise ValidationError(
                "values", f"{len(names)} names, {len(values)} values, {len(refused)} digests"
            )
        results = []
        for name, parts, digest in zip(names, values, refused, strict=True):
            value = b"".join(parts)  # rare (a refused value): through Mooncake's own buffers
            with self._call() as client:
                held = bytes(client.get(name) or b"")  # b"": none
                if (
                    held
                    and len(held) == len(value)
                    and hashlib.sha1(held, usedforsecurity=False).hexdigest() != digest
                ):
                    results.append(True)  # another engine's value, stored meanwhile
                    continue
                rc = int(client.upsert(name, value, self._config))
            if rc in UNAVAILABLE:
                raise StoreUnavailable(f"{self.options.where}: upsert returned {rc}")
            results.append(rc == 0)
        return results

    def get(self, names: Sequence[str], buffers: Sequence[Sequence[memoryview]]) -> list[int]:
        names = list(names)
        if len(buffers) != len(names):
            raise ValidationError("buffers", f"{len(buffers)} buffers for {len(names)} names")
        if not names:
            return []
        with self._call() as client:
            plan = Plan(self, [[as_bytes(p, "buffers", writable=True) for p in parts] for parts in buffers])
            try:
                codes = list(client.batch_get_into_multi_buffers(names, plan.ptrs, plan.sizes))
                self._check_answered("batch_get_into_multi_buffers", codes, len(names))
                codes = self._shorter_values(client, names, plan, codes)
                plan.stage_out(codes)
            finally:
                plan.release()
        return [code if code >= 0 else ABSENT if code in NOT_HELD else FAILED for code in codes]

    def _shorter_values(self, client: Any, names: list[str], plan: Plan, codes: list[int]) -> list[int]:
        """Read again the values shorter than their buffers, into the buffers' first bytes.

        Mooncake's transfer fails (TRANSFER_FAIL) unless the buffers add up to the value's
        size exactly; a value larger than them fails earlier, as INVALID_PARAMS.
        """
        retry: list[int] = []
        for i, code in enumerate(codes):
            if code == TRANSFER_FAIL and sum(plan.sizes[i]) > 0:
                size = int(client.get_size(names[i]))
                if 0 < size < sum(plan.sizes[i]):
                    plan.trim(i, size)
                    retry.append(i)
                elif size in NOT_HELD:
                    codes[i] = size
        if retry:
            again = client.batch_get_into_multi_buffers(
                [names[i] for i in retry], [plan.ptrs[i] for i in retry], [plan.sizes[i] for i in retry]
            )
            for i, code in zip(retry, again, strict=True):
                codes[i] = int(code)
        return codes

    def _check_answered(self, call: str, codes: list[int], count: int) -> None:
        if len(codes) != count or all(code in UNAVAILABLE for code in codes):
            bad = sorted(set(codes)) or [f"{len(codes)} answers"]
            raise StoreUnavailable(f"{self.options.where}: {call} returned {bad}")

    # -- staging ------------------------------------------------------------------------

    def _take_staging(self, size: int) -> Staging:
        with self._staging_lock:
            fits = [s for s in self._free_staging if s.size >= size]
            if fits:
                area = min(fits, key=lambda s: s.size)
                self._free_staging.remove(area)
                return area
        area = Staging(self._client, max(MIN_STAGING, 1 << (size - 1).bit_length()))
        if area.rc != 0:
            raise StoreUnavailable(f"{self.options.where}: registering a staging area failed (rc {area.rc})")
        with self._staging_lock:
            self._all_staging.append(area)
        return area

    def _give_staging(self, area: Staging) -> None:
        with self._staging_lock:
            self._free_staging.append(area)
            if len(self._free_staging) <= self.concurrency:
                return
            # keep at most one free area per concurrent call: drop the smallest
            drop = min(self._free_staging, key=lambda s: s.size)
            self._free_staging.remove(drop)
            self._all_staging.remove(drop)
        self._client.unregister_buffer(drop.address)

    def close(self) -> None:
        """Finish the calls in flight, unregister this client's memory and disconnect (idempotent)."""
        with self._state:
            if self._closed:
                return
            self._closed = True
            self._state.wait_for(lambda: self._calls == 0)
        try:
            # best effort: Mooncake's close tears its transfer engine down with them anyway
            for start, _ in self._ranges:
                self._client.unregister_buffer(start)
            for area in self._all_staging:
                self._client.unregister_buffer(area.address)
        finally:
            self._ranges.clear()
            self._free_staging.clear()
            self._all_staging.clear()
            self._client.close()
