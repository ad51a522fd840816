"""A Redis store over TLS whose certificate is bad: nothing is read from it or written to it.

Three bad certificates, each served by a real ``redis-server`` on loopback: one signed by a CA
the fleet does not trust (a server that is not the fleet's store), one expired, one for another
host. Both clients kvhal uses refuse each (redis-py, which connects first, and glide, which
moves the values), the remote tier starts down (a warning naming the certificate's fault; with
``remote_strict`` an error), and a store whose certificate goes bad while an engine runs is
refused from then on. The control in each test: the same server with the good certificate is
served.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvhal.errors import TierError
from kvhal.testing.redis_servers import RedisServer, TlsCerts, make_tls_certs
from kvhal.tiers.backend import OK
from kvhal.tiers.remote.store import StoreUnavailable
from kvhal.tiers.stores import redis_glide
from kvhal.tiers.stores.redis import RedisStore
from kvhal.tiers.stores.redis_url import parse_url
from tests.test_remote_tier import fresh_keys, open_tier, slot_bytes

#: flaw -> what each client's refusal says (redis-py's, glide's)
FLAWS = {
    "untrusted CA": ("unable to get local issuer certificate", "BadSignature"),
    "expired": ("certificate has expired", "Expired"),
    "another host": ("IP address mismatch", "not valid for name"),
}


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> dict[str, TlsCerts]:
    """The fleet's good certificates, and a server certificate with each flaw (the client
    trusts the CA each URL names: the fleet's, for the untrusted one)."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl CLI is not on PATH (needed to make test certificates)")
    root = tmp_path_factory.mktemp("tls")
    good = make_tls_certs(root / "good")
    rogue = make_tls_certs(root / "rogue")
    return {
        "good": good,
        "untrusted CA": TlsCerts(ca=good.ca, cert=rogue.cert, key=rogue.key),
        "expired": make_tls_certs(root / "expired", days=-1),
        "another host": make_tls_certs(root / "elsewhere", hosts=("elsewhere.example",)),
    }


def tls_server(certs: TlsCerts) -> RedisServer:
    try:
        return RedisServer(tls=certs)
    except RuntimeError as exc:  # a redis-server built without TLS refuses the tls-* directives
        if "Bad directive" in str(exc) or "TLS" in str(exc):
            pytest.skip(f"this redis-server cannot serve TLS: {str(exc).splitlines()[-1]}")
        raise


@pytest.fixture
def good_server(certs) -> Iterator[RedisServer]:
    with tls_server(certs["good"]) as server:
        yield server


def unchecked(server: RedisServer):
    """A plain client of ``server`` that does not check its certificate (the test's own hands)."""
    return server.client(ssl_cert_reqs="none", ssl_check_hostname=False)


@pytest.mark.parametrize("flaw", FLAWS)
def test_a_bad_certificate_is_refused_by_both_clients_and_the_tier_starts_down(certs, host, flaw):
    said_by_redis_py, said_by_glide = FLAWS[flaw]
    keys = fresh_keys(1)
    # the control: the good certificate is served (and gives the genuine value planted below)
    with tls_server(certs["good"]) as server:
        tier = open_tier(f"{server.url}&timeout=2", host)
        try:
            assert tier.write(keys, [0]).result(10) == [True]
            assert tier.read(keys, [8]).result(10) == [OK]
            name = tier.names(keys)[0]
            genuine = server.client().get(name)
        finally:
            tier.close()
    with tls_server(certs[flaw]) as server:
        unchecked(server).set(name, genuine)  # served, were the certificate not checked
        url = f"{server.url}&timeout=2"
        with pytest.raises(StoreUnavailable, match=f"certificate verify failed: {said_by_redis_py}"):
            RedisStore.from_url(url)
        if redis_glide.unsupported(parse_url(url)) is None:
            glide = redis_glide.GlideStoreClient(parse_url(url), "the test's store")
            with pytest.raises(StoreUnavailable, match=f"invalid peer certificate: .*{said_by_glide}"):
                glide.connect()
            glide.close()
        with pytest.raises(TierError, match="remote_strict"):
            open_tier(url, host, strict=True)
        changes: list[tuple[bool, str]] = []
        tier = open_tier(url, host, on_health=lambda up, why: changes.append((up, why)), retry_seconds=0)
        try:
            assert [up for up, _ in changes] == [False] and said_by_redis_py in changes[0][1]
            assert tier.read(keys, [8]).result(10) != [OK], "a value read past a bad certificate"
            assert tier.write(fresh_keys(1), [0]).result(10) == [False]
        finally:
            tier.close()
        assert unchecked(server).dbsize() == 1, "a value written past a bad certificate"
        # the negative control: with the check turned off, the planted value is served
        blind = open_tier(f"{url}&ssl_cert_reqs=none&ssl_check_hostname=false", host)
        try:
            assert blind.read(keys, [9]).result(10) == [OK] and slot_bytes(host, 9) == slot_bytes(host, 0)
        finally:
            blind.close()


def test_a_certificate_that_goes_bad_while_running_is_refused_from_then_on(certs, good_server, host):
    """The store restarts with a certificate from another CA, as a server put in its place
    would, holding the genuine values: the running tier's next connections are refused; the
    good one back, it is served."""
    tier = open_tier(f"{good_server.url}&timeout=1", host, retry_seconds=0)
    try:
        keys = fresh_keys(2)
        assert tier.write(keys[:1], [0]).result(10) == [True]
        assert tier.read(keys[:1], [8]).result(10) == [OK]
        name = tier.names(keys[:1])[0]
        genuine = good_server.client().get(name)
        swap(good_server, certs["untrusted CA"])
        unchecked(good_server).set(name, genuine)  # served, were the certificate not checked
        for _ in range(2):  # each try waits for its deadline (the URL's timeout) and fails
            assert tier.read(keys[:1], [8]).result(10) != [OK]
            assert tier.write(keys[1:], [1]).result(10) == [False]
        assert not tier.up
        swap(good_server, certs["good"])
        deadline = time.monotonic() + 10
        while tier.write(keys[1:], [1]).result(10) != [True]:
            assert time.monotonic() < deadline, "the tier never came back with the good certificate"
            time.sleep(0.2)
        assert tier.read(keys[1:], [9]).result(10) == [OK] and slot_bytes(host, 9) == slot_bytes(host, 1)
    finally:
        tier.close()


def swap(server: RedisServer, certs: TlsCerts) -> None:
    """Restart ``server`` on its port serving ``certs``'s certificate (its URL keeps its CA)."""
    server.stop()
    server.tls = TlsCerts(ca=Path(server.tls.ca), cert=certs.cert, key=certs.key)
    server.start()


@pytest.mark.parametrize(
    "options, said",
    [
        ("ssl_check_hostname=false", "ssl_check_hostname=False"),
        ("ssl_check_hostname=false&ssl_cert_reqs=none", "ssl_cert_reqs=none and ssl_check_hostname=False"),
    ],
)
def test_a_certificate_check_turned_off_in_the_url_is_warned_at_start(certs, options, said, caplog):
    """An operator may turn the check off (here it lets in a certificate for another host);
    kvhal says at every start what that lets in. The control: the check on says nothing."""
    with tls_server(certs["another host"]) as server, caplog.at_level("WARNING", "kvhal.tiers.stores.redis"):
        RedisStore.from_url(f"{server.url}&{options}").close()
    assert f"{said} in remote_url: the server's certificate is not checked" in caplog.text
    caplog.clear()
    with tls_server(certs["good"]) as server, caplog.at_level("WARNING", "kvhal.tiers.stores.redis"):
        RedisStore.from_url(server.url).close()
    assert "is not checked" not in caplog.text
