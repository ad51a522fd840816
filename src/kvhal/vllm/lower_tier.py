"""Opening the tier below host memory for a vLLM engine: the scheduler's and the workers' side."""

from __future__ import annotations

import dataclasses
import logging
from typing import Literal

from kvhal.errors import ValidationError
from kvhal.registry import PluginRegistry
from kvhal.tiers.backend import TierBackend
from kvhal.tiers.media import open_tier
from kvhal.vllm.config import HASH_SEED_VARIABLE, ConnectorConfig, LowerTierConfig

logger = logging.getLogger("vllm." + __name__)  # under "vllm": its handlers and level


def open_lower_tier(
    config: ConnectorConfig,
    lower: LowerTierConfig,
    role: Literal["index", "io"],
    rank: int,
    defer: bool = False,
) -> TierBackend:
    """Open ``lower``, a local tier of ``config``, for ``role`` (``"index"``: the scheduler;
    ``"io"``: worker ``rank``); ``defer``: the caller serves without it until it is ``ready``
    (``TierSpec.defer``).

    :raises ValidationError: a bad option, named by the user's key
        (``kv_connector_extra_config.disk_path``, ...).
    :raises TierError: the medium is owned by another engine, or unsafe.
    """
    spec = dataclasses.replace(config.tier_spec(role, rank, lower.options), defer=defer)
    if role == "index" and config.fingerprint.get("hash_seed") == "random-per-process":
        from kvhal.vllm.versions import seed_advice  # the scheduler's side only: an engine's

        logger.warning(
            "kvhal: the %s tier cannot serve a restarted engine: vLLM's %s block hashes take a random "
            "seed per process; set %s to the same value for every engine%s to keep it",
            lower.backend,
            config.fingerprint.get("hash_algo"),
            HASH_SEED_VARIABLE,
            seed_advice(),
        )
    try:
        backend = open_tier(lower.backend, spec, PluginRegistry())
    except ValidationError as exc:
        key = lower.config_keys.get(exc.argument)
        if key is None:
            raise
        message = str(exc).removeprefix(f"{exc.argument}: ")
        raise ValidationError(key, message) from exc
    if role == "index":
        logger.info(
            "kvhal: %s tier of %d slots of %d bytes (writes: %s, eviction: %s)",
            lower.backend,
            backend.num_slots,
            config.slot_bytes,
            lower.write,
            lower.eviction_policy,
        )
    return backend
