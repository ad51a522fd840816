"""The scheduler side's lookup of the remote store: how many blocks after a local hit it holds.

A lookup that the local tiers end short asks the store (``remote_url``) whether it holds
the following blocks, waiting up to :data:`REMOTE_LOOKUP_WAIT_S` for the answer; the
request is asked again (``None``) until the answer comes or ``remote_lookup_timeout_ms``
passes (a miss). The answer is kept in the request's :class:`~kvhal.vllm.request_state.Probe`,
and answers for a later lookup of the same blocks too.
"""

from __future__ import annotations

import time
from concurrent import futures

from kvhal.offload.manager import BlockState
from kvhal.tiers.chain import TierChain
from kvhal.tiers.remote.tier import RemoteTier
from kvhal.vllm.config import ConnectorConfig
from kvhal.vllm.keys import offload_key
from kvhal.vllm.request_state import Probe, RequestState
from kvhal.vllm.stats import KVHALStats

#: How long a lookup waits for the store to say whether it holds a request's blocks: a
#: round trip of a millisecond or less, where answering ``None`` costs the request a step.
REMOTE_LOOKUP_WAIT_S = 0.005


def lookup_store(
    remote: RemoteTier,
    config: ConnectorConfig,
    stats: KVHALStats,
    chain: TierChain,
    state: RequestState,
    start: int,
    hashes: list[bytes],
    hit: int,
    name: str,
) -> int | None:
    """How many blocks after the local hit the remote tier holds (for every group),
    within the host tier's room; ``None`` while the store has not answered. ``name``: the
    store's, for its counters."""
    assert config.remote_tier is not None
    groups = [g.group_id for g in config.groups]
    first, wanted = start + hit, hashes[hit:]
    probe = state.probe
    # The last probe answers for a later first block too (a prefetch from the store
    # made its blocks host blocks): no second round trip, no step lost to it.
    offset = first - probe.first if probe is not None else -1
    if (
        probe is None
        or offset < 0
        or (offset > 0 and probe.blocks is None)
        or probe.hashes[offset : offset + len(wanted)] != wanted
    ):
        keys = [offload_key(h, g) for h in wanted for g in groups]
        timeout = config.remote_tier.lookup_timeout_ms / 1000
        probe = state.probe = Probe(first, wanted, remote.exist(keys), time.monotonic() + timeout)
        stats.add_tier("tier_lookups", name, 1)
        offset = 0
        futures.wait([probe.future], timeout=REMOTE_LOOKUP_WAIT_S)
    if probe.blocks is None:
        if not probe.future.done():
            if time.monotonic() < probe.deadline:
                return None
            probe.blocks = 0
            stats.add_tier("tier_lookup_timeouts", name, 1)
        elif probe.future.exception() is not None:
            probe.blocks = 0
            stats.add_tier("tier_lookup_errors", name, 1)
        else:
            found = probe.future.result()
            n = len(groups)
            held = [all(found[i * n : (i + 1) * n]) for i in range(len(probe.hashes))]
            probe.blocks = held.index(False) if False in held else len(held)
    blocks = max(0, min(probe.blocks - offset, len(wanted)))
    for i, block_hash in enumerate(wanted[:blocks]):
        # a block still being stored to the host tier is neither loadable nor fetchable yet
        if any(chain.host.state(offload_key(block_hash, g)) is BlockState.STORING for g in groups):
            blocks = i
            break
    if blocks:
        local = [offload_key(h, g) for h in hashes[:hit] for g in groups]
        blocks = min(blocks, chain.room(local) // len(groups))
    state.fetch = {offload_key(h, g) for h in wanted[:blocks] for g in groups}
    return blocks
