"""An object store on the S3 API as the shared remote store: AWS S3, MinIO, Ceph RGW, SeaweedFS.

The URL (``remote_url``), its options and where the credentials come from:
:mod:`kvhal.tiers.stores.s3_url`.

Each value is one object under its name (``PREFIX/kvhal/v2/NAMESPACE/KEY``), moved by
obstore (Rust's ``object_store``): every request runs in its Rust runtime with the GIL
released, many at once on one event-loop thread of this store (``max_requests`` in flight),
so a batch costs one round trip's latency, not one per value. BENCHMARKS.md ("S3 clients")
has the measurement that chose it over boto3.

- ``exist``: a ``HEAD`` per name; 404 is absent. A lookup asks only a few names of its run
  of blocks (``sparse_exist``; :mod:`kvhal.tiers.remote.run_search`): 13 ``HEAD`` s for a
  returning user's 64 blocks, in one round where only the new turn's blocks are absent.
- ``put``: a ``PUT`` with ``If-None-Match: *`` (obstore's create mode): names are
  content-addressed, so an object already there counts as stored and is never uploaded over
  (412); two engines storing one block upload it once each at most, and one wins.
- ``replace`` (a value kvhal refused): the object is read again (as much as a block's value
  and one byte more) with its ETag; unless it is a value of the block's length other than
  the one refused, it is written with ``If-Match`` on that ETag, so a value another engine
  stored meanwhile is never overwritten (412: it is looked at again, once).
- ``get``: a range ``GET`` of the value's buffer size + 1 bytes, copied into the buffers (one
  copy: obstore hands a buffer of its own); a value longer than its buffers is FAILED,
  never read past them; 404 is absent. ``get_ranges`` the same from a byte offset: the tail
  of a run of blocks stored as one object (``run_blocks``, :mod:`kvhal.tiers.remote.runs`:
  about 1 MiB an object by default, so a returning user's context is a few requests).

Errors: a name whose request failed alone (a 4xx, a 5xx while others of the batch were
answered) is that name's failure (``False``, ``FAILED``). Where no request of a call was
answered because the server is down, stalled past ``timeout``, answers 5xx or 503 ``SlowDown``
after ``retries`` (obstore's backoff), refuses the credentials (401, 403), or the bucket does
not exist (``NoSuchBucket``), the call raises
:class:`~kvhal.tiers.remote.store.StoreUnavailable`: the tier marks itself down and its
hits are recomputed. A call never waits longer than its requests' bounds, plus a margin.

Connecting (:meth:`S3Store.from_url`) reads one name nobody writes: a 404 ``NoSuchKey``
says the bucket is there and the credentials are taken; a missing bucket or refused
credentials raise StoreUnavailable with the reason (the tier starts down and tries again,
or with ``remote_strict`` the engine does not start). kvhal never lists the bucket.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import logging
import math
import re
import threading
from collections.abc import Awaitable, Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar

from kvhal.errors import ValidationError
from kvhal.threads import name_this_thread
from kvhal.tiers.remote.runs import run_blocks_for
from kvhal.tiers.remote.store import ABSENT, FAILED, RemoteStore, StoreUnavailable
from kvhal.tiers.stores.s3_url import ARGUMENT, S3Target, credentials_source, parse_url

__all__ = ["S3Store"]

log = logging.getLogger(__name__)
T = TypeVar("T")

MISSING_CLIENT = "s3:// needs obstore: pip install obstore (or kvhal[s3])"
MISSING_BOTO3 = "a profile's credentials are read through boto3: pip install boto3"
#: a name nobody writes (kvhal's names start with kvhal/v): read once at connect
CONNECT_CHECK = "kvhal-connect-check"
_STATUS = re.compile(r"status code: (\d{3})")
#: S3's error codes for credentials it does not take (AWS answers ExpiredToken with a 400)
CREDENTIALS_REFUSED = (
    "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken",
    "TokenRefreshRequired", "RequestTimeTooSkewed", "AuthorizationHeaderMalformed",
)  # fmt: skip
#: seconds a call may wait beyond its requests' own bounds (obstore's timeouts and retries)
MARGIN = 2.0


def _load_client() -> Any:
    try:
        import obstore
    except ImportError as exc:
        raise ValidationError(ARGUMENT, MISSING_CLIENT) from exc
    return obstore


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().split("\n", 1)[0]
    return f"{type(exc).__name__}: {text[:300]}" if text else type(exc).__name__


class _Unavailable(Exception):
    """One request's failure that says the store, not the name, is at fault."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


def _classify(exc: BaseException, where: str) -> BaseException:
    """``exc`` as :class:`_Unavailable` where it says the store cannot serve, else as it is
    (that one request's failure)."""
    from obstore import exceptions as obx

    text = str(exc)
    if "NoSuchBucket" in text:
        return _Unavailable(f"{where}: the bucket does not exist")
    refused = next((code for code in CREDENTIALS_REFUSED if code in text), None)
    if refused is not None:
        return _Unavailable(f"{where}: the server refused the credentials ({refused}): {_first_line(exc)}")
    if isinstance(exc, (obx.PermissionDeniedError, obx.UnauthenticatedError)):
        if "AccessDenied" in text:  # a policy refusing this request (a read-only key's write)
            return exc
        # a HEAD's 403 has no body to say why: the credentials, as far as one can tell
        return _Unavailable(f"{where}: refused (401/403): {_first_line(exc)}")
    status = _status(exc)
    if status is None or status >= 500:  # no answer (refused, reset, timed out) or 5xx
        return _Unavailable(f"{where}: {_first_line(exc)}")
    return exc


def _status(exc: BaseException) -> int | None:
    """The HTTP status an obstore error reports, or None (no answer)."""
    found = _STATUS.search(str(exc))
    return int(found.group(1)) if found else None


def _scatter(data: memoryview, parts: Sequence[memoryview]) -> int:
    offset = 0
    for part in parts:
        if offset == len(data):
            break
        n = min(len(part), len(data) - offset)
        part[:n] = data[offset : offset + n]
        offset += n
    return len(data)


def _flat(part: memoryview) -> memoryview:
    return part if part.format == "B" and part.ndim == 1 else part.cast("B")


class S3Store(RemoteStore):
    """A connected S3 client (see the module's docstring); build it with :meth:`from_url`.

    Thread-safe: kvhal's threads submit their batches to this store's event loop.
    """

    concurrency = 4
    sparse_exist = True

    def __init__(self, target: S3Target) -> None:
        """Build the client and start its event loop; nothing is sent (use :meth:`from_url`).

        :raises ValidationError: obstore (or boto3, for a profile) is not installed.
        """
        self._obstore = _load_client()
        self.target = target
        self.where = target.where
        self._client = self._build(target)
        # a request's bound: obstore starts no retry after retries + 1 timeouts (its
        # retry_timeout), the last one may take a timeout more, and backoffs are at most 1 s
        self._request_bound = target.timeout * (target.retries + 2) + 1.0
        self._loop = asyncio.new_event_loop()
        self._requests = asyncio.Semaphore(target.max_requests)
        self._thread = threading.Thread(target=self._run_loop, name="kvhal-s3", daemon=True)
        self._thread.start()
        self._closed = False
        self._lock = threading.Lock()

    @classmethod
    def from_url(cls, url: str) -> S3Store:
        """Connect to the bucket an ``s3://`` URL names, and check it is there.

        :raises ValidationError: (``remote_url``) a malformed URL or option, checked before
            anything is sent; or obstore is not installed.
        :raises StoreUnavailable: the server cannot be reached, refuses the credentials, or
            the bucket does not exist.
        """
        store = cls(parse_url(url))
        try:
            store._check_bucket()
        except BaseException:
            store.close()
            raise
        if not store.target.tls_verify:
            log.warning(
                "kvhal: %s: tls_verify=false in remote_url: the server's certificate is not checked, so "
                "anyone on the network path can answer as the store (a value still proves its block; "
                "only with a remote secret can none be forged)",
                store.where,
            )
        return store

    def _build(self, t: S3Target) -> Any:
        from obstore.store import S3Store as ObjectStoreS3

        client_options: dict[str, Any] = {
            "timeout": timedelta(seconds=t.timeout),
            "connect_timeout": timedelta(seconds=min(t.timeout, 5.0)),
            "pool_max_idle_per_host": str(t.max_requests),
        }
        if t.endpoint is not None and t.endpoint.startswith("http://"):
            client_options["allow_http"] = True
        if t.ca_file is not None:
            with open(t.ca_file, "rb") as pem:
                client_options["root_certificate"] = pem.read()
        if not t.tls_verify:
            client_options["allow_invalid_certificates"] = True
        retry = {
            "max_retries": t.retries,
            "retry_timeout": timedelta(seconds=t.timeout * (t.retries + 1)),
            "backoff": {"init_backoff": timedelta(milliseconds=50), "max_backoff": timedelta(seconds=1)},
        }
        config: dict[str, Any] = {
            "region": t.region,
            "virtual_hosted_style_request": t.addressing == "virtual",
        }
        if t.endpoint is not None:
            config["endpoint"] = t.endpoint
        return ObjectStoreS3(
            t.bucket,
            prefix=t.prefix or None,
            config=config,
            client_options=client_options,
            retry_config=retry,
            credential_provider=self._profile_provider(t),
        )

    @staticmethod
    def _profile_provider(t: S3Target) -> Any:
        if t.profile is None:
            return None  # obstore's own chain: the AWS_* variables, web identity, ECS, IMDS
        try:
            import boto3
            from obstore.auth.boto3 import Boto3CredentialProvider
        except ImportError as exc:
            raise ValidationError(ARGUMENT, f"profile {t.profile!r}: {MISSING_BOTO3}") from exc
        try:
            session = boto3.Session(profile_name=t.profile)
        except Exception as exc:  # botocore's ProfileNotFound, a malformed config file
            raise ValidationError(ARGUMENT, f"profile {t.profile!r}: {_first_line(exc)}") from None
        return Boto3CredentialProvider(session)

    def __repr__(self) -> str:
        return f"S3Store({self.where})"

    @property
    def object_store(self) -> Any:
        """obstore's client below this store (a benchmark's limit moves bytes through it)."""
        return self._client

    # -- the event loop ----------------------------------------------------------------------

    def _run_loop(self) -> None:
        name_this_thread()  # obstore's runtime threads, started from here, carry the name too
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    def _batch(self, count: int, one: Callable[[int], Awaitable[T]]) -> list[T | BaseException]:
        """``one(i)`` for every ``i < count``, at most ``max_requests`` at once; each result or
        its exception (obstore's, classified). Raises StoreUnavailable when none was answered."""

        async def limited(i: int) -> T:
            async with self._requests:
                return await one(i)

        async def gather() -> list[T | BaseException]:
            return await asyncio.gather(*(limited(i) for i in range(count)), return_exceptions=True)

        if not count:
            return []
        with self._lock:
            if self._closed:
                raise StoreUnavailable(f"{self.where}: this client is closed")
            future = asyncio.run_coroutine_threadsafe(gather(), self._loop)
        waves = math.ceil(count / self.target.max_requests)
        bound = waves * self._request_bound + MARGIN
        try:
            results = future.result(bound)
        except concurrent.futures.TimeoutError:
            future.cancel()  # obstore's requests are dropped with their tasks
            raise StoreUnavailable(f"{self.where}: no answer within {bound:.1f} s") from None
        except concurrent.futures.CancelledError:
            raise StoreUnavailable(f"{self.where}: this client is closed") from None
        if any(isinstance(r, asyncio.CancelledError) for r in results):
            raise StoreUnavailable(f"{self.where}: this client is closed")
        results = [_classify(r, self.where) if isinstance(r, Exception) else r for r in results]
        unavailable = [r for r in results if isinstance(r, _Unavailable)]
        if unavailable and len(unavailable) == len(results):
            raise StoreUnavailable(unavailable[0].why)
        return results

    # -- the contract --------------------------------------------------------------------------

    def _check_bucket(self) -> None:
        obstore = self._obstore

        async def probe(i: int) -> bool:
            try:
                await obstore.get_range_async(self._client, CONNECT_CHECK, start=0, length=1)
            except FileNotFoundError as exc:
                if "NoSuchBucket" in str(exc):
                    raise  # classified as unavailable; NoSuchKey: the bucket is there
            return True

        try:
            (result,) = self._batch(1, probe)
        except StoreUnavailable as exc:
            source = credentials_source(self.target)
            raise StoreUnavailable(f"{exc} (credentials: {source})") from None
        if isinstance(result, BaseException):  # a 4xx other than 404: say so, the tier retries
            raise StoreUnavailable(f"{self.where}: the connect check failed: {_first_line(result)}")

    def exist(self, names: Sequence[str]) -> list[bool]:
        names = list(names)
        obstore = self._obstore

        async def head(i: int) -> bool:
            try:
                await obstore.head_async(self._client, names[i])
            except FileNotFoundError as exc:
                if "NoSuchBucket" in str(exc):
                    raise
                return False
            return True

        # a name whose HEAD failed alone is not known to be there
        return [r is True for r in self._batch(len(names), head)]

    def put(self, names: Sequence[str], values: Sequence[Sequence[memoryview]]) -> list[bool]:
        names = list(names)
        if len(values) != len(names):
            raise ValidationError("values", f"{len(values)} values for {len(names)} names")
        obstore, exceptions = self._obstore, self._obstore.exceptions
        mode = "create" if self.target.conditional else "overwrite"

        async def put(i: int) -> bool:
            parts = values[i]
            data = _flat(parts[0]) if len(parts) == 1 else b"".join(parts)
            # there already (412): content-addressed, so the same block
            with contextlib.suppress(exceptions.AlreadyExistsError, exceptions.PreconditionError):
                await obstore.put_async(self._client, names[i], data, mode=mode, use_multipart=False)
            return True

        # 409 ConditionalRequestConflict (AWS): another create of the name is in flight
        results = self._batch(len(names), put)
        return [r is True or (isinstance(r, Exception) and _status(r) == 409) for r in results]

    def replace(
        self, names: Sequence[str], values: Sequence[Sequence[memoryview]], refused: Sequence[str]
    ) -> list[bool]:
        names = list(names)
        if not len(names) == len(values) == len(refused):
            raise ValidationError(
                "values", f"{len(names)} names, {len(values)} values, {len(refused)} digests"
            )
        obstore, exceptions = self._obstore, self._obstore.exceptions

        async def replace(i: int) -> bool:
            value = b"".join(values[i])  # rare (a refused value): joined once
            for _ in range(2):  # changed between the read and the write: look once more
                data, etag = await self._held(names[i], len(value) + 1)
                genuine = data is not None and len(data) == len(value)
                if genuine and hashlib.sha1(data, usedforsecurity=False).hexdigest() != refused[i]:
                    return True  # a value of a block's length other than the one refused: kept
                if not self.target.conditional:
                    mode: Any = "overwrite"
                elif data is None:
                    mode = "create"
                elif etag:
                    mode = {"e_tag": etag}
                else:
                    return False  # the server gave no ETag to replace it on
                try:
                    await obstore.put_async(self._client, names[i], value, mode=mode, use_multipart=False)
                    return True
                except (exceptions.AlreadyExistsError, exceptions.PreconditionError):
                    continue
            return False

        return [r is True for r in self._batch(len(names), replace)]

    async def _held(self, name: str, most: int) -> tuple[bytes | None, str | None]:
        """At most ``most`` bytes of the object ``name`` and its ETag; ``(None, None)``: none."""
        obstore = self._obstore
        try:
            held = await obstore.get_async(self._client, name, options={"range": (0, most)})
            return bytes(await held.bytes_async()), held.meta.get("e_tag")
        except FileNotFoundError as exc:
            if "NoSuchBucket" in str(exc):
                raise
            return None, None
        except obstore.exceptions.GenericError as exc:
            if _status(exc) != 416:
                raise
            # an empty object: no range of it can be read, its ETag comes with a HEAD
            return b"", (await obstore.head_async(self._client, name)).get("e_tag")

    def run_blocks(self, value_bytes: int) -> int:
        return self.target.run_blocks or run_blocks_for(value_bytes)

    def get(self, names: Sequence[str], buffers: Sequence[Sequence[memoryview]]) -> list[int]:
        return self.get_ranges(names, [0] * len(names), buffers)

    def get_ranges(
        self, names: Sequence[str], starts: Sequence[int], buffers: Sequence[Sequence[memoryview]]
    ) -> list[int]:
        names = list(names)
        if len(buffers) != len(names) or len(starts) != len(names):
            raise ValidationError(
                "buffers", f"{len(buffers)} buffers, {len(starts)} starts for {len(names)} names"
            )
        if any(start < 0 for start in starts):
            raise ValidationError("starts", "a value is read from a byte offset >= 0")
        views = [[_flat(part) for part in parts] for parts in buffers]
        sizes = [sum(len(part) for part in parts) for parts in views]
        obstore = self._obstore

        async def get(i: int) -> Any:
            try:
                # one byte more than the buffers hold: a longer value is seen, never read whole
                return await obstore.get_range_async(
                    self._client, names[i], start=starts[i], length=sizes[i] + 1
                )
            except FileNotFoundError as exc:
                if "NoSuchBucket" in str(exc):
                    raise
                return None

        results: list[int] = []
        for data, parts, size in zip(self._batch(len(names), get), views, sizes, strict=True):
            if data is None:
                results.append(ABSENT)
            elif isinstance(data, BaseException):
                results.append(FAILED)  # (an empty object, or one ending before the start: 416)
            else:
                view = memoryview(data)
                results.append(FAILED if len(view) > size else _scatter(view, parts))
        return results

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True

        async def shutdown() -> None:  # the calls in flight end as closed, not at their bound
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()
            self._loop.stop()

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop)
        self._thread.join(10)
        if not self._thread.is_alive():
            self._loop.close()
