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
from kvhal.vllm.remote import open_remote_tier, read_secret
from kvhal.vllm.stats import KVHALStats
from tests.test_scheduler_side import scheduler_config

#: nothing listens here: a tier that opens starts down, one refused never tries
URL = "redis://127.0.0.1:9/0"


@pytest.fixture(autouse=True)
def _no_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVHAL_REMOTE_SECRET", raising=False)


def config(**remote):
    return dataclasses.replace(scheduler_config(), remote_tier=RemoteTierConfig(URL, **remote))


def test_without_a_secret_the_engine_does_not_start():
    with pytest.raises(ValidationError) as refused:
        open_remote_tier(config(), "index", 0, KVHALStats())
    assert refused.value.argument == "kv_connector_extra_config.remote_auth"
    for named in ("KVHAL_REMOTE_SECRET", "remote_secret_file", 'remote_auth: "none"'):
        assert named in str(refused.value)


def test_the_explicit_opt_out_opens_and_says_so(caplog):
    with caplog.at_level(logging.WARNING):
        tier = open_remote_tier(config(auth="none"), "index", 0, KVHALStats())
    assert tier.secret is None
    assert any('remote_auth is "none"' in r.getMessage() for r in caplog.records)
    tier.close()


def test_the_secret_comes_from_the_environment_or_a_file(tmp_path, monkeypatch):
    path = tmp_path / "secret"
    path.write_bytes(b"  fleet secret \nignored second line\n")
    assert read_secret(RemoteTierConfig(URL, secret_file=str(path))) == b"fleet secret"
    tier = open_remote_tier(config(secret_file=str(path)), "index", 0, KVHALStats())
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
        open_remote_tier(config(secret_file=str(path)), "index", 0, KVHALStats())
    assert refused.value.argument == "kv_connector_extra_config.remote_secret_file"
