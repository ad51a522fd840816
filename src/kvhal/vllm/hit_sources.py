"""Which tier served a hit, for vLLM's ``vllm:prompt_tokens_cached_by_source`` (0.32).

vLLM 0.32's scheduler asks a connector, right after ``update_state_after_alloc``, to split a
request's hit by source (``get_external_cache_hit_sources``: ``dict[CacheHitSource, int]``
summing to the hit; a mismatch is counted as ``external_unspecified`` with a warning). Its
sources are kinds of tier, not names: ``host``, ``disk``, ``p2p`` and
``external_unspecified`` ("an uninstrumented connector or a remote store"). kvhal answers
by kind: its host tier as ``host``, a local tier below it (the disk tier, a plugin's
backend) as ``disk``, a store the fleet shares as ``external_unspecified``. Two local tiers,
or two stores, share a source there; kvhal's own ``vllm:kvhal_tier_hit_tokens{tier=...}``
names each tier (the dashboard's hit ratio by tier reads those). vLLM 0.27.1 has no sources.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from kvhal.vllm.versions import HIT_SOURCES

HOST, LOCAL, SHARED = "host", "local", "shared"


def split_hit(
    count: int,
    block_size: int,
    block_of: Mapping[bytes, int],
    read_from: Mapping[str, Collection[bytes]],
    order: Sequence[str],
) -> dict[str, int]:
    """A hit of ``count`` blocks' tokens by the tier that served them: a block by the tier
    farthest down ``order`` that one of its groups' keys was read from (as vLLM's
    ``CacheHitSource.outermost``), else ``"host"``. Sums to ``count * block_size``.

    :param block_of: each key of the hit -> its block's index in the request.
    :param read_from: tier name -> the keys read from it (at the prefetch, or by the load).
    :param order: the tiers below the host tier, top to bottom.
    """
    if not read_from:  # the usual host hit: every block's tokens are the host tier's
        return {HOST: count * block_size} if count else {}
    rank = {name: i for i, name in enumerate(order)}
    tier_of: dict[int, str] = {}
    for name, keys in read_from.items():
        for key in keys:
            index = block_of.get(key)
            if index is None:
                continue
            now = tier_of.get(index)
            if now is None or rank.get(name, -1) > rank.get(now, -1):
                tier_of[index] = name
    split = {name: blocks * block_size for name, blocks in Counter(tier_of.values()).items()}
    host = count * block_size - sum(split.values())
    if host:
        split[HOST] = host
    return split


def by_kind(split: Mapping[str, int], shared: Collection[str], num_tokens: int) -> dict[str, int]:
    """``split`` (tokens by tier name) by kind of tier: ``host``, ``local`` or ``shared``
    (``shared``: the stores' names); all ``host`` where it does not sum to ``num_tokens``
    (no split recorded: the hit was planned without a load)."""
    if sum(split.values()) != num_tokens:
        return {HOST: num_tokens} if num_tokens else {}
    kinds: dict[str, int] = {}
    for name, tokens in split.items():
        kind = HOST if name == HOST else SHARED if name in shared else LOCAL
        kinds[kind] = kinds.get(kind, 0) + tokens
    return {kind: tokens for kind, tokens in kinds.items() if tokens}


def vllm_sources(kinds: Mapping[str, int]) -> dict[Any, int]:
    """:func:`by_kind`'s answer as vLLM's ``CacheHitSource`` counts (empty on a vLLM without)."""
    if HIT_SOURCES is None:
        return {}
    sources: dict[Any, int] = {}
    for kind, tokens in kinds.items():
        source = HIT_SOURCES[kind]
        sources[source] = sources.get(source, 0) + tokens
    return sources
