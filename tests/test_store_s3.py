"""The built-in S3 store (kvhal.tiers.stores.s3) against a real SeaweedFS S3 gateway.

No mocks: every test talks to the session's SeaweedFS (``seaweedfs`` in tests/conftest.py),
signing with its credentials from the AWS variables, or through a loopback TCP proxy in front
of it. About 10 s here beside the server's start (4 s, shared by the S3 modules).
"""

from __future__ import annotations

import array
import hashlib
import os
import random
import sys
import threading
import time
import uuid
from collections.abc import Iterator

import pytest

from kvhal.errors import ValidationError
from kvhal.registry import PluginRegistry
from kvhal.testing.seaweedfs_servers import REGION, SeaweedS3
from kvhal.testing.tcp_proxy import TcpProxy
from kvhal.tiers.media import available_stores, open_store
from kvhal.tiers.remote.store import ABSENT, FAILED, StoreUnavailable
from kvhal.tiers.remote.urls import redact
from kvhal.tiers.stores.s3 import S3Store
from kvhal.tiers.stores.s3_url import parse_url

obstore = pytest.importorskip("obstore")


def use_credentials(monkeypatch: pytest.MonkeyPatch, credentials: dict[str, str]) -> None:
    """Exactly ``credentials`` in the AWS variables (the machine's own must not leak in)."""
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    for name, value in credentials.items():
        monkeypatch.setenv(name, value)


@pytest.fixture(autouse=True)
def _credentials(monkeypatch: pytest.MonkeyPatch, seaweedfs: SeaweedS3) -> None:
    use_credentials(monkeypatch, seaweedfs.credentials)


@pytest.fixture
def store(seaweedfs: SeaweedS3) -> Iterator[S3Store]:
    s = open_store(seaweedfs.url(prefix=f"t-{uuid.uuid4().hex[:8]}"), PluginRegistry())
    assert isinstance(s, S3Store)
    yield s
    s.close()


def names(n: int) -> list[str]:
    run = uuid.uuid4().hex[:8]
    return [f"kvhal/v2/ns/{run}-{i}" for i in range(n)]


def parts_of(data: bytes, cuts: list[int]) -> list[memoryview]:
    view, out, start = memoryview(data), [], 0
    for cut in [*cuts, len(data)]:
        out.append(view[start:cut])
        start = cut
    return out


def buffers_for(sizes: list[int]) -> list[memoryview]:
    return [memoryview(bytearray(b"\xee" * n)) for n in sizes]


def joined(buffers: list[memoryview], n: int) -> bytes:
    return b"".join(bytes(b) for b in buffers)[:n]


def test_s3_is_a_built_in_scheme():
    assert "s3" in available_stores(PluginRegistry(autoload=False))


def test_round_trip_of_multi_part_binary_values(store):
    rng = random.Random(7)
    keys = names(4)
    payloads = [rng.randbytes(n) for n in (1, 1000, 4096, 65536 + 17)]
    cuts = [[], [10, 10, 500], [4095], [1, 30000, 60000]]  # an empty part in the second
    values = [parts_of(p, c) for p, c in zip(payloads, cuts, strict=True)]
    assert store.exist(keys) == [False] * 4
    assert store.put(keys, values) == [True] * 4
    assert store.exist([*keys, names(1)[0]]) == [True] * 4 + [False]
    # buffers cut differently from the values, and some longer than the value
    buffers = [buffers_for(s) for s in ([1], [300, 300, 500], [10, 10_000], [65536, 100])]
    got = store.get([*keys, names(1)[0]], [*buffers, buffers_for([8])])
    assert got == [*(len(p) for p in payloads), ABSENT]
    for payload, buf, n in zip(payloads, buffers, got, strict=False):
        assert joined(buf, n) == payload
    assert bytes(buffers[1][2][400:]) == b"\xee" * 100, "bytes past the value stay untouched"


def test_a_value_longer_than_its_buffers_fails_and_a_shorter_one_fills_their_first_bytes(store):
    (name,) = names(1)
    assert store.put([name], [[memoryview(b"0123456789")]]) == [True]
    small, exact, large = buffers_for([4, 5]), buffers_for([10]), buffers_for([8, 8])
    assert store.get([name] * 3, [small, exact, large]) == [FAILED, 10, 10]
    assert joined(exact, 10) == joined(large, 10) == b"0123456789"


def test_an_oversized_value_is_never_read_past_its_buffers(seaweedfs):
    """A 16 MiB object under a block's name: the read asks for the buffers' size + 1 bytes, so
    what crosses the network is that much (counted by a proxy), not the object."""
    (name,) = names(1)
    obstore.put(seaweedfs.objects(), f"big/{name}", b"\0" * (16 << 20))
    with TcpProxy(seaweedfs.port) as proxy:
        endpoint = f"http://127.0.0.1:{proxy.port}"
        store = open_store(seaweedfs.url(prefix="big", endpoint=endpoint), PluginRegistry())
        before = proxy.to_client
        assert store.get([name], [buffers_for([4096])]) == [FAILED]
        assert proxy.to_client - before < 8192, f"{proxy.to_client - before} bytes came back"
        # negative control: a plain GET through the same proxy brings the whole object
        before = proxy.to_client
        obstore.get(seaweedfs.objects(endpoint=endpoint), f"big/{name}").bytes()
        assert proxy.to_client - before >= 16 << 20
        store.close()


def test_an_existing_name_is_never_uploaded_over(store, seaweedfs):
    (name,) = names(1)
    assert store.put([name], [[memoryview(b"first")]]) == [True]
    assert store.put([name], [[memoryview(b"second!")]]) == [True], "there already: stored"
    buf = buffers_for([16])
    assert store.get([name], [buf]) == [5] and joined(buf, 5) == b"first"
    key = f"{store.target.prefix}/{name}"
    assert bytes(obstore.get(seaweedfs.objects(), key).bytes()) == b"first"


def test_without_conditional_writes_a_put_overwrites(seaweedfs):
    """conditional=false, for servers that refuse If-None-Match: the negative control of the
    test above (an existing name is uploaded over)."""
    store = open_store(seaweedfs.url(prefix="plain", conditional="false"), PluginRegistry())
    (name,) = names(1)
    assert store.put([name], [[memoryview(b"first")]]) == [True]
    assert store.put([name], [[memoryview(b"second!")]]) == [True]
    buf = buffers_for([16])
    assert store.get([name], [buf]) == [7] and joined(buf, 7) == b"second!"
    store.close()


def sha1(data: bytes) -> str:
    return hashlib.sha1(data, usedforsecurity=False).hexdigest()


def test_replace_takes_a_refused_value_s_place_only(store, seaweedfs):
    """A refused value (its SHA-1 given), a value of another length, an empty object and a
    missing name are replaced; a value of the new one's length that is not the refused one (a
    genuine value another engine stored meanwhile) is kept."""
    refused, other_length, empty, missing, genuine = names(5)
    objects = seaweedfs.objects()
    planted = {refused: b"P" * 8, other_length: b"long value", empty: b"", genuine: b"G" * 8}
    for name, data in planted.items():
        obstore.put(objects, f"{store.target.prefix}/{name}", data)
    new = [memoryview(b"NEW-"), memoryview(b"BLK!")]
    targets = [refused, other_length, empty, missing, genuine]
    digests = [sha1(b"P" * 8), "", "", "", sha1(b"something else")]
    assert store.replace(targets, [new] * 5, digests) == [True] * 5
    out = [buffers_for([8]) for _ in targets]
    assert store.get(targets, out) == [8] * 5
    assert [joined(b, 8) for b in out] == [b"NEW-BLK!"] * 4 + [b"G" * 8]


def test_bytes_read_back_are_the_bytes_written(store):
    # negative control: a one-byte change in the source shows in what is read back
    a, b = names(2)
    source = bytearray(random.Random(3).randbytes(3000))
    assert store.put([a], [[memoryview(source)[:1000], memoryview(source)[1000:]]]) == [True]
    source[1234] ^= 0x01
    assert store.put([b], [[memoryview(bytes(source))]]) == [True]
    bufs_a, bufs_b = buffers_for([3000]), buffers_for([3000])
    assert store.get([a, b], [bufs_a, bufs_b]) == [3000, 3000]
    got_a, got_b = joined(bufs_a, 3000), joined(bufs_b, 3000)
    assert got_b == bytes(source)
    assert [i for i in range(3000) if got_a[i] != got_b[i]] == [1234]


def test_non_byte_memoryviews_move_their_bytes(store):
    (name,) = names(1)
    ints = array.array("i", range(100))
    assert store.put([name], [[memoryview(ints)]]) == [True]
    out = array.array("i", [0] * 100)
    assert store.get([name], [[memoryview(out)]]) == [400]
    assert out == ints


def test_a_batch_larger_than_max_requests_runs_in_waves(seaweedfs):
    store = open_store(seaweedfs.url(prefix="waves", max_requests=3), PluginRegistry())
    keys = names(20)
    values = [[memoryview(f"value {i}".encode())] for i in range(20)]
    assert store.put(keys, values) == [True] * 20
    out = [buffers_for([16]) for _ in keys]
    sizes = store.get(keys, out)
    assert [joined(b, n) for b, n in zip(out, sizes, strict=True)] == [
        f"value {i}".encode() for i in range(20)
    ]
    store.close()


def test_four_threads_share_one_store(store):
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        try:
            keys = names(8)
            data = [random.Random(seed * 100 + i).randbytes(5000) for i in range(8)]
            assert store.put(keys, [[memoryview(d)] for d in data]) == [True] * 8
            out = [buffers_for([5000]) for _ in keys]
            assert store.get(keys, out) == [5000] * 8
            assert [joined(b, 5000) for b in out] == data
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors


def test_read_only_credentials_read_but_their_puts_fail(store, seaweedfs, monkeypatch):
    (name,) = names(1)
    assert store.put([name], [[memoryview(b"written")]]) == [True]
    use_credentials(monkeypatch, seaweedfs.read_only_credentials)
    reader = open_store(store_url(seaweedfs, store), PluginRegistry())
    buf = buffers_for([16])
    assert reader.get([name], [buf]) == [7] and joined(buf, 7) == b"written"
    assert reader.put(names(2), [[memoryview(b"x")]] * 2) == [False, False], "AccessDenied: per name"
    reader.close()


def store_url(seaweedfs: SeaweedS3, store: S3Store) -> str:
    return seaweedfs.url(prefix=store.target.prefix)


# --- connecting: credentials, the bucket, the server --------------------------------------------


def test_wrong_credentials_are_unavailable_naming_the_refusal_never_the_secret(seaweedfs, monkeypatch):
    secret = "wrong-secret-4471"
    use_credentials(monkeypatch, {"AWS_ACCESS_KEY_ID": "kvhal-test-admin", "AWS_SECRET_ACCESS_KEY": secret})
    with pytest.raises(StoreUnavailable, match="SignatureDoesNotMatch") as raised:
        open_store(seaweedfs.url(), PluginRegistry())
    assert secret not in str(raised.value) and "kvhal-test-admin" not in str(raised.value)
    use_credentials(monkeypatch, {"AWS_ACCESS_KEY_ID": "nobody", "AWS_SECRET_ACCESS_KEY": secret})
    with pytest.raises(StoreUnavailable, match="InvalidAccessKeyId"):
        open_store(seaweedfs.url(), PluginRegistry())


def test_credentials_of_a_profile(seaweedfs, monkeypatch, tmp_path):
    """profile= reads the AWS config files through boto3 (real files, the real server)."""
    pytest.importorskip("boto3")
    credentials = tmp_path / "credentials"
    credentials.write_text(
        f"[fleet]\naws_access_key_id = {seaweedfs.credentials['AWS_ACCESS_KEY_ID']}\n"
        f"aws_secret_access_key = {seaweedfs.credentials['AWS_SECRET_ACCESS_KEY']}\n"
        "[stale]\naws_access_key_id = kvhal-test-admin\naws_secret_access_key = not-it\n"
    )
    use_credentials(monkeypatch, {"AWS_SHARED_CREDENTIALS_FILE": str(credentials)})
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    store = open_store(seaweedfs.url(profile="fleet"), PluginRegistry())
    assert store.exist(names(1)) == [False]
    store.close()
    with pytest.raises(StoreUnavailable, match=r"SignatureDoesNotMatch.*profile 'stale'"):
        open_store(seaweedfs.url(profile="stale"), PluginRegistry())
    monkeypatch.setenv("AWS_PROFILE", "fleet")  # the variable, as AWS's tools read it
    open_store(seaweedfs.url(), PluginRegistry()).close()
    with pytest.raises(ValidationError, match="profile 'absent'"):
        open_store(seaweedfs.url(profile="absent"), PluginRegistry())


def test_a_bucket_that_does_not_exist_is_unavailable_until_created(seaweedfs):
    bucket = f"kvhal-missing-{uuid.uuid4().hex[:6]}"
    with pytest.raises(StoreUnavailable, match=f"s3://{bucket}.*the bucket does not exist"):
        open_store(seaweedfs.url(bucket=bucket), PluginRegistry())
    seaweedfs.create_bucket(bucket)
    try:
        store = open_store(seaweedfs.url(bucket=bucket), PluginRegistry())
        assert store.put(names(1), [[memoryview(b"v")]]) == [True]
        store.close()
    finally:
        seaweedfs.delete_bucket(bucket)


def test_no_server_is_unavailable_quickly(seaweedfs):
    with TcpProxy(seaweedfs.port) as proxy:
        endpoint = f"http://127.0.0.1:{proxy.port}"
    started = time.monotonic()
    with pytest.raises(StoreUnavailable, match="error sending request"):
        open_store(seaweedfs.url(endpoint=endpoint), PluginRegistry())  # the port is closed now
    assert time.monotonic() - started < 5


def test_close_is_idempotent_and_later_calls_are_unavailable(store):
    store.close()
    store.close()
    with pytest.raises(StoreUnavailable, match="closed"):
        store.exist(names(1))


# --- the URL ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("s3://", "bucket ''"),
        ("s3://Upper/x", "bucket 'Upper'"),
        ("s3://ab", "bucket 'ab'"),
        ("s3://b..b", "bucket"),
        ("s3://bucket/a//b", "part ''"),
        ("s3://bucket/a/../b", "part '..'"),
        ("s3://bucket/sp ace", "part 'sp ace'"),
        ("s3://bucket?endpoint=ftp://h", "endpoint must be an http"),
        ("s3://bucket?endpoint=http://h:0", "endpoint must be an http"),
        ("s3://bucket?endpoint=http://h/path", "without a path"),
        ("s3://bucket?endpoint=http://u:p@h", "must not hold credentials"),
        ("s3://bucket?addressing=dns", "addressing must be path or virtual"),
        ("s3://bucket?timeout=0", "timeout must be a positive"),
        ("s3://bucket?timeout=nan", "timeout must be a positive"),
        ("s3://bucket?timeout=1e10", "timeout must be a positive"),
        ("s3://bucket?retries=11", "retries must be an integer in 0..10"),
        ("s3://bucket?max_requests=0", "max_requests must be an integer in 1..1024"),
        ("s3://bucket?conditional=maybe", "conditional must be true or false"),
        ("s3://bucket?endpoint=http://h&ca_file=/x", "ca_file needs an https"),
        ("s3://bucket?endpoint=http://h&tls_verify=false", "tls_verify needs an https"),
        ("s3://bucket?ca_file=/no/such.pem", "no file '/no/such.pem'"),
        ("s3://bucket?region=a%20b", "region 'a b'"),
        ("s3://bucket?profile=a%20b", "profile 'a b'"),
        ("s3://bucket?bogus=1", "unknown option 'bogus'"),
        ("s3://bucket?timeout=1&timeout=2", "given twice"),
        ("s3://bucket#frag", "fragment"),
        ("redis://bucket", "is not s3"),
    ],
)
def test_malformed_urls_name_remote_url_before_any_byte_moves(url, says):
    with pytest.raises(ValidationError, match=says) as raised:
        parse_url(url, environ={})
    assert raised.value.argument == "remote_url"


@pytest.mark.parametrize(
    "url",
    [
        "s3://AKIAEXAMPLE:s3cr3tValue@bucket/p",
        "s3://bucket/p?secret_access_key=s3cr3tValue",
        "s3://bucket/p?access_key_id=AKIAEXAMPLE&aws_secret=s3cr3tValue",
        "s3://bucket/p?session_token=s3cr3tValue",
    ],
)
def test_credentials_in_the_url_are_refused_and_never_echoed(url):
    with pytest.raises(ValidationError, match="credentials") as raised:
        parse_url(url, environ={})
    assert "s3cr3tValue" not in str(raised.value) and "AKIAEXAMPLE" not in str(raised.value)
    assert "s3cr3tValue" not in redact(url), "and a log of the URL would not show them either"


def test_url_defaults_and_the_environment():
    aws = parse_url("s3://bucket/fleet/a", environ={})
    assert (aws.bucket, aws.prefix, aws.endpoint, aws.region, aws.addressing) == (
        "bucket", "fleet/a", None, REGION, "virtual",
    )  # fmt: skip
    assert (aws.timeout, aws.retries, aws.max_requests, aws.conditional, aws.profile) == (
        5.0,
        2,
        32,
        True,
        None,
    )
    env = {"AWS_REGION": "eu-west-3", "AWS_ENDPOINT_URL": "http://minio:9000", "AWS_PROFILE": "p"}
    local = parse_url("s3://bucket", environ=env)
    assert (local.endpoint, local.region, local.addressing, local.profile) == (
        "http://minio:9000", "eu-west-3", "path", "p",
    )  # fmt: skip
    keys = parse_url("s3://bucket", environ={**env, "AWS_ACCESS_KEY_ID": "k"})
    assert keys.profile is None, "keys in the environment come before AWS_PROFILE, as in AWS's tools"
    given = parse_url("s3://bucket?endpoint=https://rgw:7480/&region=default&addressing=virtual", environ=env)
    assert (given.endpoint, given.region, given.addressing) == ("https://rgw:7480", "default", "virtual")


def test_without_obstore_the_module_loads_and_the_url_is_refused_with_the_fix(monkeypatch):
    """obstore is imported when a store connects, not with kvhal's stores (a fresh copy of the
    module, loaded while obstore cannot be imported)."""
    import importlib.util

    import kvhal.tiers.stores.s3 as module

    monkeypatch.setitem(sys.modules, "obstore", None)  # the import fails as when not installed
    spec = importlib.util.spec_from_file_location("kvhal_s3_copy", module.__file__)
    assert spec is not None and spec.loader is not None
    copy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(copy)
    with pytest.raises(ValidationError, match=r"pip install obstore \(or kvhal\[s3\]\)") as refused:
        copy.S3Store.from_url("s3://bucket/p?endpoint=http://127.0.0.1:1")
    assert refused.value.argument == "remote_url"
