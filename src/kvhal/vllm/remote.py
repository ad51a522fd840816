"""Opening the shared remote tier (``remote_url``) for a vLLM engine: scheduler and workers."""

from __future__ import annotations

from typing import Literal

from vllm.logger import init_logger

from kvhal import env
from kvhal.errors import ValidationError
from kvhal.offload.host_tier import HostTier
from kvhal.tiers.remote.tier import RemoteTier, redact
from kvhal.vllm.config import HASH_SEED_VARIABLE, ConnectorConfig
from kvhal.vllm.stats import KVHALStats

logger = init_logger("vllm." + __name__)  # under "vllm": its handlers and level
SECRET_VARIABLE = "KVHAL_REMOTE_SECRET"
URL_KEY = "kv_connector_extra_config.remote_url"


def open_remote_tier(
    config: ConnectorConfig,
    role: Literal["index", "io"],
    rank: int,
    stats: KVHALStats,
    host: HostTier | None = None,
) -> RemoteTier:
    """Open ``config``'s remote tier for ``role`` (``"index"``: the scheduler; ``"io"``: worker ``rank``).

    An unreachable store is a warning and a tier that starts down (it keeps
    trying), or a :class:`~kvhal.errors.TierError` with ``remote_strict``.

    :raises ValidationError: a malformed ``remote_url``, named by the user's key.
    """
    remote = config.remote_tier
    assert remote is not None
    url = redact(remote.url)
    spec = config.tier_spec(role, rank)
    if role == "index" and config.fingerprint.get("hash_seed") == "random-per-process":
        logger.warning(
            "kvhal: the remote tier %s cannot share blocks between engines: vLLM's %s block hashes take "
            "a random seed per process; set %s to the same value for every engine (or use sha256)",
            url,
            config.fingerprint.get("hash_algo"),
            HASH_SEED_VARIABLE,
        )
    secret = env.read(SECRET_VARIABLE)

    def on_health(up: bool, why: str) -> None:
        if up:
            logger.info("kvhal: remote tier %s (%s) is reachable: %s", url, role, why)
        else:
            stats.add("remote_unreachable", 1)
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
            secret=secret.encode() if secret else None,
            strict=remote.strict,
            on_health=on_health,
        )
    except ValidationError as exc:
        if exc.argument != "remote_url":
            raise
        raise ValidationError(URL_KEY, str(exc).removeprefix("remote_url: ")) from exc
    if role == "index" and url != remote.url:
        logger.warning(
            "kvhal: remote_url holds a password, and vLLM logs kv_transfer_config whole at start: "
            "give it in KVHAL_REDIS_PASSWORD (or the store's own setting) instead"
        )
    if role == "index":
        logger.info(
            "kvhal: remote tier %s (HMAC: %s, lookups %d ms, loads %d ms, at most %d blocks written at once)",
            url,
            "on" if secret else f"off, {SECRET_VARIABLE} unset",
            remote.lookup_timeout_ms,
            remote.load_timeout_ms,
            remote.max_inflight_blocks,
        )
    return tier
