"""Redis (one server or a Redis Cluster) as the shared remote store.

Each value is one binary Redis string under its name, written with ``SET NX`` (names are
content-addressed: an existing value is never replaced) and read with ``GETRANGE name 0
SIZE``, at most one byte more than the value can be (an oversized value is never read whole);
batches are pipelined. A name holding a value kvhal refused is written again by a Lua script
that replaces only that value (:meth:`RedisStore.replace`). Nothing is pickled. Reads of one
plain-TCP server go through kvhal's own reader, which receives each value straight into its
host slot with the GIL released (:mod:`kvhal.tiers.stores.redis_direct`); other reads, and
writes, go through valkey-glide where it is installed, for one server and for a cluster
(:mod:`kvhal.tiers.stores.redis_glide`: its I/O does not wait on the engine's GIL); lookups go
through redis-py.
``KVHAL_REDIS_READER`` (``direct``, ``glide``, ``redis-py``) picks another for comparison.

The URL (``remote_url``), its options and the credentials: :mod:`kvhal.tiers.stores.redis_url`.

Eviction is the Redis server's job: give it ``maxmemory`` and an ``allkeys-lru`` (or
``allkeys-lfu``) policy, or use ``ttl``. A full server with neither refuses writes (``put``
answers False for them) and still serves reads.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import redis
import redis.exceptions as rex
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry

from kvhal import env
from kvhal.errors import ValidationError
from kvhal.tiers.remote.store import ABSENT, FAILED, RemoteStore, StoreUnavailable
from kvhal.tiers.stores import redis_direct, redis_glide
from kvhal.tiers.stores.redis_url import ARGUMENT, RedisTarget, parse_url, unchecked_tls

__all__ = ["RedisStore"]

log = logging.getLogger(__name__)

#: who may read values (``KVHAL_REDIS_READER``), best first: one that cannot read the URL
#: (the direct reader: TLS, a cluster; glide: a redis-py TLS option) falls back to the next
READERS = ("direct", "glide", "redis-py")
#: commands per pipeline, and the value bytes one put pipeline holds at most (bounds the
#: memory of joined values and the size of one round trip)
PIPELINE_COMMANDS = 128
PIPELINE_BYTES = 64 << 20
#: SET the new value (ARGV[1]) unless the name holds a value of its length other than the one
#: refused (SHA-1 ARGV[2]): a genuine value is never replaced; ARGV[3]: the TTL, "" none.
#: One script runs atomically, so no engine's write lands between the check and the SET.
REPLACE_SCRIPT = """
local held = redis.call('GET', KEYS[1])
if held and #held == #ARGV[1] and redis.sha1hex(held) ~= ARGV[2] then return 0 end
if ARGV[3] ~= '' then redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[3])
else redis.call('SET', KEYS[1], ARGV[1]) end
return 1
"""


#: errors that mean the store (or a node of it) did not answer, as opposed to one command failing.
#: ClusterError is raised when a cluster command ran out of redirections/retries;
#: RedisClusterException when no seed node answers or slots are not covered.
_UNAVAILABLE: tuple[type[BaseException], ...] = (
    rex.ConnectionError,  # also AuthenticationError, BusyLoadingError, MaxConnectionsError
    rex.TimeoutError,
    rex.ClusterDownError,  # also MasterDownError
    rex.ClusterError,
    rex.TryAgainError,
    rex.RedisClusterException,
    OSError,
)


def _auth_failure(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) is the server refusing the credentials."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, rex.AuthenticationError):
            return True
        if isinstance(current, rex.ResponseError) and str(current).startswith(("NOAUTH", "WRONGPASS")):
            return True
        current = current.__cause__ or current.__context__
    return False


def _bytes_view(part: memoryview) -> memoryview:
    """``part`` as a flat view of bytes (its length is then its size in bytes)."""
    return part if part.format == "B" and part.ndim == 1 else part.cast("B")


class RedisStore(RemoteStore):
    """A connected Redis or Redis Cluster client; build it with :meth:`from_url`.

    Thread-safe: redis-py clients hand each call its own pooled connection.
    """

    concurrency = 4

    def __init__(self, target: RedisTarget, reader: str | None = None) -> None:
        """Connect to ``target`` and PING it (use :meth:`from_url`).

        :raises StoreUnavailable: it does not answer.
        :raises ValidationError: it refused the credentials.
        """
        reader = _reader_asked(reader)  # checked before anything connects
        self._target = target
        self._lock = threading.Lock()
        self._closed = False
        self._stale = False
        self._client: Any = None
        self._client = self._connect()
        if unchecked := unchecked_tls(target):
            log.warning(
                "kvhal: %s: %s in remote_url: the server's certificate is not checked, so anyone "
                "on the network path can answer as the store (a value still proves its block; "
                "only with a remote secret can none be forged)",
                self._what,
                unchecked,
            )
        # the reads' and writes' client, once the server answered redis-py (its errors are the clearer)
        glide = reader != "redis-py" and redis_glide.unsupported(target) is None
        self._glide = redis_glide.GlideStoreClient(target, self._what) if glide else None
        # reads straight into host slots, where the URL allows (one plain-TCP server)
        self._direct = (
            redis_direct.DirectReader(target, self._what)
            if reader == "direct" and redis_direct.unsupported(target) is None
            else None
        )
        if self._glide is not None:
            try:  # connected now: a first read that connects would measure the store slow
                self._glide.connect()
            except StoreUnavailable:
                self._client.close()
                raise

    @classmethod
    def from_url(cls, url: str, reader: str | None = None) -> RedisStore:
        """Connect to the server or cluster ``url`` names (see :mod:`kvhal.tiers.stores.redis_url`).

        :param reader: who reads values (one of :data:`READERS`; default ``KVHAL_REDIS_READER``,
            else ``direct``).

        :raises ValidationError: the URL or an option is malformed (nothing was connected),
            or the server refused the credentials; the argument is ``remote_url``.
        :raises StoreUnavailable: the server does not answer.
        """
        return cls(parse_url(url), reader)

    def __repr__(self) -> str:
        t = self._target
        db = "" if t.cluster else f"/{t.db}"
        return f"RedisStore({t.scheme}://{t.where}{db}, ttl={t.ttl})"

    @property
    def _what(self) -> str:
        kind = "redis cluster" if self._target.cluster else "redis"
        return f"{kind} at {self._target.where}"

    def _connect(self) -> Any:
        t = self._target
        options: dict[str, Any] = {
            "username": t.username,
            "password": t.password,
            "socket_timeout": t.timeout,
            "socket_connect_timeout": t.timeout,
            "decode_responses": False,
            # one immediate retry: enough to replace a pooled connection the server closed
            # (a restart), without redis-py's default backoff stretching an outage's calls
            "retry": Retry(NoBackoff(), 1),
            **t.options,
        }
        if t.tls:
            options["ssl"] = True
            # the host name checked unless the URL says otherwise (redis-py 5 did not by
            # default), where the certificate is (ssl refuses a host check without it)
            if t.options.get("ssl_cert_reqs") != "none":
                options.setdefault("ssl_check_hostname", True)
        client: Any = None
        try:
            if t.cluster:
                # builds the slot map from the seed, so it already talks to the cluster
                client = RedisCluster(host=t.host, port=t.port, **options)
            else:
                client = redis.Redis(host=t.host, port=t.port, db=t.db, **options)
            if t.cluster:
                # a connection to every primary now: opened lazily, they would fall on the
                # first lookups, which have a budget of a few hundred milliseconds
                client.ping(target_nodes=RedisCluster.PRIMARIES)
            else:
                client.ping()
        except Exception as exc:
            if client is not None:
                client.close()
            if _auth_failure(exc):
                user = repr(t.username) if t.username else "default"
                raise ValidationError(
                    ARGUMENT,
                    f"the Redis server at {t.where} refused the credentials "
                    f"(user {user}; password {t.password_source})",
                ) from None  # the cause may echo what was sent
            if isinstance(exc, _UNAVAILABLE):
                raise StoreUnavailable(f"{self._what}: {_describe(exc)}") from exc
            if isinstance(exc, rex.ResponseError):  # e.g. SELECT of a database it does not have
                raise ValidationError(ARGUMENT, f"the Redis server at {t.where} answered: {exc}") from exc
            raise
        return client

    def _current(self) -> Any:
        """The client to use now; after a failure on a cluster, a new one.

        redis-py before 8 drops each unreachable node from a RedisCluster's startup nodes, so
        after a whole-cluster outage that client never finds the cluster again (8.1 recovers by
        itself); a new client, built from the seed, works with both.
        """
        with self._lock:
            if self._closed:
                raise StoreUnavailable(f"{self._what}: the store is closed")
            if self._stale:
                fresh = self._connect()  # raises StoreUnavailable while the cluster is still down
                old, self._client, self._stale = self._client, fresh, False
                old.close()
            return self._client

    def _failed(self, client: Any, exc: BaseException) -> StoreUnavailable:
        if self._target.cluster:
            with self._lock:
                if self._client is client:
                    self._stale = True
        return StoreUnavailable(f"{self._what}: {_describe(exc)}")

    def _pipelined(
        self, count: int, add: Callable[[Any, int], int], raise_on_error: bool = False
    ) -> list[object]:
        """Run ``add(pipe, i)`` for i in ``range(count)`` in pipelines; the replies, in order.

        ``add`` returns the bytes it queued, to bound a pipeline's size.
        """
        client = self._current()
        replies: list[object] = []
        try:
            i = 0
            while i < count:
                pipe = client.pipeline(transaction=False)
                queued = size = 0
                while i < count and queued < PIPELINE_COMMANDS and size < PIPELINE_BYTES:
                    size += add(pipe, i)
                    queued += 1
                    i += 1
                replies.extend(pipe.execute(raise_on_error=raise_on_error))
        except _UNAVAILABLE as exc:
            raise self._failed(client, exc) from exc
        # a cluster pipeline can report a node's failure as that command's reply
        for reply in replies:
            if isinstance(reply, _UNAVAILABLE):
                raise self._failed(client, reply) from reply
        return replies

    def exist(self, names: Sequence[str]) -> list[bool]:
        def add(pipe: Any, i: int) -> int:
            pipe.exists(names[i])
            return 0

        replies = self._pipelined(len(names), add)
        # another error (a refused command) says nothing about the name: not known to exist
        return [isinstance(r, int) and r > 0 for r in replies]

    def put(self, names: Sequence[str], values: Sequence[Sequence[memoryview]]) -> list[bool]:
        if len(names) != len(values):
            raise ValueError(f"{len(names)} names but {len(values)} values")
        ttl = self._target.ttl

        def joined(parts: Sequence[memoryview]) -> bytes | memoryview:
            # one part goes out as it is (redis-py sends a memoryview without copying it)
            return _bytes_view(parts[0]) if len(parts) == 1 else b"".join(parts)

        if self._glide is not None:  # (a closed store's glide client says so itself)
            # joined as set_new takes them: a batch's worth at a time, as the pipelines below
            replies = self._glide.set_new(names, (joined(parts) for parts in values), ttl)
            return [not isinstance(r, BaseException) for r in replies]

        def add(pipe: Any, i: int) -> int:
            value = joined(values[i])
            pipe.set(names[i], value, nx=True, ex=ttl)
            return len(value)

        replies = self._pipelined(len(names), add)
        # SET NX answers None when the name exists already: stored, by another writer
        return [not isinstance(r, BaseException) for r in replies]

    def replace(
        self, names: Sequence[str], values: Sequence[Sequence[memoryview]], refused: Sequence[str]
    ) -> list[bool]:
        if not len(names) == len(values) == len(refused):
            raise ValueError(f"{len(names)} names, {len(values)} values, {len(refused)} digests")
        ttl = "" if not self._target.ttl else str(self._target.ttl)

        def add(pipe: Any, i: int) -> int:  # rare (a refused value): redis-py, the script sent whole
            value = b"".join(values[i])
            pipe.eval(REPLACE_SCRIPT, 1, names[i], value, refused[i], ttl)
            return len(value)

        if self._target.cluster:  # redis-py's cluster pipelines refuse EVAL: one call per name
            replies = [
                self._one(
                    lambda c, i=i: c.eval(REPLACE_SCRIPT, 1, names[i], b"".join(values[i]), refused[i], ttl)
                )
                for i in range(len(names))
            ]
        else:
            replies = self._pipelined(len(names), add)
        # 0: the name holds another value of a block's length (another engine's): stored
        return [not isinstance(r, BaseException) for r in replies]

    def _one(self, call: Callable[[Any], object]) -> object:
        """``call(client)``: its reply, or the error of a refused command."""
        client = self._current()
        try:
            return call(client)
        except _UNAVAILABLE as exc:
            raise self._failed(client, exc) from exc
        except rex.RedisError as exc:
            return exc

    def get(self, names: Sequence[str], buffers: Sequence[Sequence[memoryview]]) -> list[int]:
        if len(names) != len(buffers):
            raise ValueError(f"{len(names)} names but {len(buffers)} buffers")
        if self._direct is not None:
            return self._direct.getrange_into(names, [[_bytes_view(p) for p in parts] for parts in buffers])
        sizes = [sum(len(_bytes_view(part)) for part in parts) for parts in buffers]
        if self._glide is not None:  # (a closed store's glide client says so itself)
            replies = self._glide.getrange(names, sizes)
        else:

            def add(pipe: Any, i: int) -> int:
                pipe.getrange(names[i], 0, sizes[i])
                return 0

            replies = self._pipelined(len(names), add)
        results: list[int] = []
        for reply, parts, size in zip(replies, buffers, sizes, strict=True):
            if not isinstance(reply, bytes):
                results.append(FAILED)  # that command was refused (a name holding a list, say)
            elif not reply:  # GETRANGE of a missing name (an empty value is no block either)
                results.append(ABSENT)
            elif len(reply) > size:  # larger than the buffers (read SIZE + 1 bytes, no more)
                results.append(FAILED)
            else:
                results.append(_scatter(reply, parts))
        return results

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            client, self._client = self._client, None
        if client is not None:
            client.close()
        if self._glide is not None:
            self._glide.close()
        if self._direct is not None:
            self._direct.close()


def _reader_asked(reader: str | None) -> str:
    """Who reads values, checked: ``reader``, else ``KVHAL_REDIS_READER``, else ``direct``."""
    where = "reader" if reader is not None else "KVHAL_REDIS_READER"
    reader = reader or env.read("KVHAL_REDIS_READER") or "direct"
    if reader not in READERS:
        raise ValidationError(where, f"must be one of {list(READERS)}, got {reader!r}")
    return reader


def _scatter(value: bytes, parts: Sequence[memoryview]) -> int:
    """Copy ``value`` over ``parts`` in order: its length, or FAILED if it does not fit."""
    views = [_bytes_view(p) for p in parts]
    if len(value) > sum(len(v) for v in views):
        return FAILED
    source = memoryview(value)
    offset = 0
    for view in views:
        if offset == len(value):
            break
        n = min(len(view), len(value) - offset)
        view[:n] = source[offset : offset + n]
        offset += n
    return len(value)


def _describe(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
