"""Opening the shared remote tier (``remote_url``) for a vLLM engine: scheduler and workers."""

from __future__ import annotations

import logging
from typing import Literal

from kvhal import env
from kvhal.errors import ValidationError
from kvhal.offload.host_tier import HostTier
from kvhal.tiers.remote.tier import RemoteTier, redact
from kvhal.vllm.config import HASH_SEED_VARIABLE, ConnectorConfig, RemoteTierConfig
from kvhal.vllm.stats import KVHALStats

logger = logging.getLogger("vllm." + __name__)  # under "vllm": its handlers and level
SECRET_VARIABLE = "KVHAL_REMOTE_SECRET"
PREVIOUS_VARIABLE = "KVHAL_REMOTE_PREVIOUS_SECRETS"
#: The most bytes a secret file may hold.
SECRET_FILE_MAX_BYTES = 4096
#: The most previous secrets (each one more HMAC per refused value, and a key still trusted).
MAX_PREVIOUS_SECRETS = 4


def read_secret(remote: RemoteTierConfig) -> bytes | None:
    """The fleet's secret: ``KVHAL_REMOTE_SECRET``, else ``remote_secret_file``'s first line.

    :raises ValidationError: the file cannot be read, is too large, or holds no secret.
    """
    return read_secrets(remote)[0]


def read_secrets(remote: RemoteTierConfig) -> tuple[bytes | None, list[bytes]]:
    """The fleet's secret and its previous ones (a rotation): values are signed with the first,
    and a value signed with any is served.

    The secret is ``KVHAL_REMOTE_SECRET``, else ``remote_secret_file``'s first line; the previous
    ones are ``KVHAL_REMOTE_PREVIOUS_SECRETS`` (comma-separated) where it is set, else the file's
    later lines (where the secret came from the file). At most :data:`MAX_PREVIOUS_SECRETS`.

    :raises ValidationError: the file cannot be read, is too large, or holds no secret; previous
        secrets without a current one, or too many.
    """
    secret = env.read(SECRET_VARIABLE)
    listed = env.read(PREVIOUS_VARIABLE)
    previous = [p.strip().encode() for p in listed.split(",")] if listed else []
    if secret:
        current: bytes | None = secret.encode()
    elif remote.secret_file is None:
        current = None
    else:
        lines = _secret_file_lines(remote)
        current = lines[0]
        if not listed:
            previous = lines[1:]
    previous = [p for p in dict.fromkeys(previous) if p and p != current]
    if previous and current is None:
        raise ValidationError(
            PREVIOUS_VARIABLE,
            f"previous secrets are only read beside a current one ({SECRET_VARIABLE} or remote_secret_file)",
        )
    if len(previous) > MAX_PREVIOUS_SECRETS:
        where = PREVIOUS_VARIABLE if listed else remote.key("secret_file")
        raise ValidationError(
            where,
            f"{len(previous)} previous secrets; at most {MAX_PREVIOUS_SECRETS} (finish a rotation first)",
        )
    return current, previous


def _secret_file_lines(remote: RemoteTierConfig) -> list[bytes]:
    """``remote_secret_file``'s non-empty lines, stripped: the secret first."""
    assert remote.secret_file is not None
    try:
        with open(remote.secret_file, "rb") as f:
            text = f.read(SECRET_FILE_MAX_BYTES + 1)
    except OSError as exc:
        raise ValidationError(
            remote.key("secret_file"), f"cannot read {remote.secret_file!r}: {exc.strerror}"
        ) from None
    if len(text) > SECRET_FILE_MAX_BYTES:
        raise ValidationError(
            remote.key("secret_file"), f"{remote.secret_file!r} has more than {SECRET_FILE_MAX_BYTES} bytes"
        )
    lines = [line.strip() for line in text.split(b"\n")]
    if not lines[0]:
        raise ValidationError(
            remote.key("secret_file"), f"{remote.secret_file!r} holds no secret (its first line is empty)"
        )
    return [line for line in lines if line]


def open_remote_tier(
    config: ConnectorConfig,
    remote: RemoteTierConfig,
    role: Literal["index", "io"],
    rank: int,
    stats: KVHALStats,
    host: HostTier | None = None,
) -> RemoteTier:
    """Open ``remote``, a store of ``config``, for ``role`` (``"index"``: the scheduler;
    ``"io"``: worker ``rank``).

    An unreachable store is a warning and a tier that starts down (it keeps
    trying), or a :class:`~kvhal.errors.TierError` with ``remote_strict``.

    :raises ValidationError: a malformed ``remote_url``, named by the user's key.
    """
    url = redact(remote.url)
    spec = config.tier_spec(role, rank)
    if role == "index" and config.fingerprint.get("hash_seed") == "random-per-process":
        from kvhal.vllm.versions import seed_advice  # the scheduler's side only: an engine's

        logger.warning(
            "kvhal: the remote tier %s cannot share blocks between engines: vLLM's %s block hashes take "
            "a random seed per process; set %s to the same value for every engine%s",
            url,
            config.fingerprint.get("hash_algo"),
            HASH_SEED_VARIABLE,
            seed_advice(),
        )
    secret, previous = read_secrets(remote)
    if secret is None and remote.auth != "none":
        raise ValidationError(
            remote.key("auth"),
            f"the remote tier {url} is written by every client of the store, so its values are "
            f"authenticated: set {SECRET_VARIABLE} to the same secret on every engine, or name a file "
            f'holding it in remote_secret_file; or opt out in so many words with remote_auth: "none" '
            "(then anyone who can write to the store can plant KV that engines serve)",
        )
    if secret is None and role == "index":
        logger.warning(
            'kvhal: remote tier %s: remote_auth is "none": values are not authenticated, and anyone who '
            "can write to the store can plant KV this engine serves; set %s to protect them",
            url,
            SECRET_VARIABLE,
        )

    def on_health(up: bool, why: str) -> None:
        if up:
            logger.info("kvhal: remote tier %s (%s) is reachable: %s", url, role, why)
        else:
            stats.add_tier("tier_unreachable", remote.name, 1)
            logger.warning(
                "kvhal: remote tier %s (%s) is unreachable (%s); its hits are recomputed and its "
                "writes dropped until it answers again",
                url,
                role,
                why,
            )

    try:
        tier = RemoteTier(
            remote.url,
            spec,
            host=host,
            secret=secret,
            previous_secrets=previous,
            on_previous_secret=lambda count: stats.add_tier(
                "tier_previous_secret_blocks", remote.name, count
            ),
            strict=remote.strict,
            on_health=on_health,
            runs=len(config.groups) == 1,  # a hybrid model's groups interleave their positions
        )
    except ValidationError as exc:
        if exc.argument != "remote_url":
            raise
        raise ValidationError(remote.key("url"), str(exc).removeprefix("remote_url: ")) from exc
    if role == "index" and url != remote.url:
        logger.warning(
            "kvhal: remote_url holds a password, and vLLM logs kv_transfer_config whole at start: "
            "give it in KVHAL_REDIS_PASSWORD (or the store's own setting) instead"
        )
    if role == "index":
        logger.info(
            "kvhal: remote tier %s (HMAC: %s, lookups %d ms, loads %d ms, at most %d blocks written at once, "
            "%s)",
            url,
            ("on" + (f", {len(previous)} previous secret(s) accepted" if previous else ""))
            if secret
            else 'off, remote_auth "none"',
            remote.lookup_timeout_ms,
            remote.load_timeout_ms,
            remote.max_inflight_blocks,
            (f"runs of {tier.run_blocks} blocks a value" if tier.run_blocks > 1 else "a value a block")
            if tier.up
            else "values per block known once connected",
        )
    return tier
