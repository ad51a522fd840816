"""Integrity by default: a remote tier opens only with the fleet's secret (the environment, or
``remote_secret_file``) or with ``remote_auth: "none"`` said in so many words, which is warned
of at every start. The refusal names every way out, before anything connects."""

from __future__ import annotations

import dataclasses
import logging

import pytest

pytest.importorskip("vllm")

from kvhal.errors import ValidationError
from kvhal.vllm.config import RemoteTierConfig
from kvhal.vllm.remote import MAX_PREVIOUS_SECRETS, open_remote_tier, read_secret, read_secrets
from kvhal.vllm.stats import KVHALStats
from tests.test_scheduler_side import scheduler_config

#: nothing listens here: a tier that opens starts down, one refused never tries
URL = "redis://127.0.0.1:9/0"


@pytest.fixture(autouse=True)
def _no_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVHAL_REMOTE_SECRET", raising=False)
    monkeypatch.delenv("KVHAL_REMOTE_PREVIOUS_SECRETS", raising=False)


def config(**remote):
    return dataclasses.replace(scheduler_config(), remote_tier=RemoteTierConfig(URL, **remote))


def open_index(connector):
    return open_remote_tier(connector, connector.remote_tier, "index", 0, KVHALStats())


def test_without_a_secret_the_engine_does_not_start():
    with pytest.raises(ValidationError) as refused:
        open_index(config())
    assert refused.value.argument == "kv_connector_extra_config.remote_auth"
    for named in ("KVHAL_REMOTE_SECRET", "remote_secret_file", 'remote_auth: "none"'):
        assert named in str(refused.value)


def test_the_explicit_opt_out_opens_and_says_so(caplog):
    with caplog.at_level(logging.WARNING):
        tier = open_index(config(auth="none"))
    assert tier.secret is None
    assert any('remote_auth is "none"' in r.getMessage() for r in caplog.records)
    tier.close()


def test_the_secret_comes_from_the_environment_or_a_file(tmp_path, monkeypatch):
    path = tmp_path / "secret"
    path.write_bytes(b"  fleet secret \n")
    assert read_secret(RemoteTierConfig(URL, secret_file=str(path))) == b"fleet secret"
    tier = open_index(config(secret_file=str(path)))
    assert tier.secret == b"fleet secret", "values would not be authenticated"
    tier.close()
    monkeypatch.setenv("KVHAL_REMOTE_SECRET", "from env")
    assert read_secret(RemoteTierConfig(URL, secret_file=str(path))) == b"from env"


@pytest.mark.parametrize("content", [None, b"\n\nsecret", b"x" * 5000])
def test_a_secret_file_that_cannot_serve_is_named(tmp_path, content):
    path = tmp_path / "secret"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ValidationError) as refused:
        open_index(config(secret_file=str(path)))
    assert refused.value.argument == "kv_connector_extra_config.remote_secret_file"


def test_previous_secrets_come_from_the_environment_or_the_files_later_lines(tmp_path, monkeypatch):
    path = tmp_path / "secret"
    path.write_bytes(b"new\n\n old \nnew\n")  # the current one repeated is no previous one
    remote = RemoteTierConfig(URL, secret_file=str(path))
    assert read_secrets(remote) == (b"new", [b"old"])
    tier = open_index(config(secret_file=str(path)))
    assert (tier.secret, tier.previous_secrets) == (b"new", (b"old",))
    tier.close()
    monkeypatch.setenv("KVHAL_REMOTE_PREVIOUS_SECRETS", "a, b")
    assert read_secrets(remote) == (b"new", [b"a", b"b"])  # the variable wins over the lines
    monkeypatch.setenv("KVHAL_REMOTE_SECRET", "env")
    assert read_secrets(RemoteTierConfig(URL)) == (b"env", [b"a", b"b"])
    monkeypatch.delenv("KVHAL_REMOTE_PREVIOUS_SECRETS")
    assert read_secrets(RemoteTierConfig(URL)) == (b"env", [])


def test_previous_secrets_alone_or_too_many_are_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("KVHAL_REMOTE_PREVIOUS_SECRETS", "old")
    with pytest.raises(ValidationError) as alone:
        read_secrets(RemoteTierConfig(URL))
    assert alone.value.argument == "KVHAL_REMOTE_PREVIOUS_SECRETS"
    monkeypatch.setenv("KVHAL_REMOTE_SECRET", "new")
    monkeypatch.setenv(
        "KVHAL_REMOTE_PREVIOUS_SECRETS", ",".join(f"s{i}" for i in range(MAX_PREVIOUS_SECRETS + 1))
    )
    with pytest.raises(ValidationError, match="at most"):
        read_secrets(RemoteTierConfig(URL))
    monkeypatch.delenv("KVHAL_REMOTE_SECRET")
    monkeypatch.delenv("KVHAL_REMOTE_PREVIOUS_SECRETS")
    path = tmp_path / "secret"
    path.write_bytes(b"\n".join(b"s%d" % i for i in range(MAX_PREVIOUS_SECRETS + 2)))
    with pytest.raises(ValidationError) as many:
        read_secrets(RemoteTierConfig(URL, secret_file=str(path)))
    assert many.value.argument == "kv_connector_extra_config.remote_secret_file"
