"""kvhal's counters as a scenario's ``metrics`` step has them (``LLM.get_metrics()``, labels
but vLLM's written after the name): ``vllm:kvhal_hit_tokens`` for an engine-wide counter,
``vllm:kvhal_tier_hit_tokens{tier=disk}`` for a tier's (the form of
``kvhal.vllm.stats.tier_key``; not imported from there: it imports vLLM, which a bench's own
process does without)."""

from __future__ import annotations

from collections.abc import Mapping
from urllib.parse import urlsplit

PREFIX = "vllm:kvhal_"
_LABEL = "{tier="


def _split(name: str) -> tuple[str, str | None]:
    """``(family, tier)`` of a name without :data:`PREFIX` (``(name, None)``: engine-wide)."""
    family, label, rest = name.partition(_LABEL)
    return (family, rest[:-1]) if label and rest.endswith("}") else (name, None)


def kvhal_counters(metrics: Mapping[str, float], tier: str | None = None) -> dict[str, float]:
    """kvhal's counters in ``metrics``, without :data:`PREFIX`: the engine-wide ones by name
    (``hit_tokens``), and tier ``tier``'s by family (``tier_hit_tokens``); other tiers' are
    left out."""
    found = {}
    for key, value in metrics.items():
        if key.startswith(PREFIX):
            family, of = _split(key.removeprefix(PREFIX))
            if of is None or of == tier:
                found[family] = value
    return found


def by_tier(metrics: Mapping[str, float], family: str) -> dict[str, float]:
    """The counters of family ``family`` (``tier_hit_tokens``) in ``metrics``, by tier name."""
    found = {}
    for key, value in metrics.items():
        if key.startswith(PREFIX):
            name, tier = _split(key.removeprefix(PREFIX))
            if name == family and tier is not None:
                found[tier] = value
    return found


def tiers(metrics: Mapping[str, float]) -> set[str]:
    """The tiers with a counter in ``metrics``."""
    found = set()
    for key in metrics:
        if key.startswith(PREFIX):
            tier = _split(key.removeprefix(PREFIX))[1]
            if tier is not None:
                found.add(tier)
    return found


def store_tier(url: str) -> str:
    """The name the store at ``url`` counts under: its URL's scheme (as
    ``kvhal.vllm.remote.remote_tier_name`` names it)."""
    return urlsplit(url).scheme or "remote"
