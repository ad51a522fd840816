"""The scheduler side's lookup of the shared stores: which blocks after the local hit each holds.

A lookup that the local tiers end short asks every store of the chain (in one round trip
each, at once) whether it holds the following blocks, waiting up to
:data:`STORE_LOOKUP_WAIT_S` for the answers; the request is asked again (``None``) until
every store answered or its lookup timeout passed (a miss). A store's answer is kept in the
request's :class:`~kvhal.vllm.request_state.Probe`, and answers for a later lookup of the
same blocks too.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent import futures
from typing import TYPE_CHECKING

from kvhal.vllm.config import ConnectorConfig
from kvhal.vllm.keys import offload_key
from kvhal.vllm.request_state import Probe, RequestState
from kvhal.vllm.stats import KVHALStats

if TYPE_CHECKING:
    from kvhal.vllm.tier_list import SchedulerTier

#: How long a lookup waits for the stores to say whether they hold a request's blocks: a
#: round trip of a millisecond or less, where answering ``None`` costs the request a step.
STORE_LOOKUP_WAIT_S = 0.005


def lookup_stores(
    stores: Sequence[SchedulerTier],
    config: ConnectorConfig,
    stats: KVHALStats,
    state: RequestState,
    start: int,
    hashes: list[bytes],
    hit: int,
) -> bool:
    """Ask each store which of the blocks after the local hit (``hashes[hit:]``, from block
    ``start``) it holds, into ``state.held``; False while a store has not answered."""
    groups = [g.group_id for g in config.groups]
    first, wanted = start + hit, hashes[hit:]
    asked = []
    for tier in stores:
        probe = state.probes.get(tier.name)
        # The last probe answers for a later first block too (a prefetch made its blocks
        # host blocks): no second round trip, no step lost to it.
        offset = first - probe.first if probe is not None else -1
        if (
            probe is None
            or offset < 0
            or (offset > 0 and probe.found is None)
            or probe.hashes[offset : offset + len(wanted)] != wanted
        ):
            assert tier.store is not None and tier.lookup_timeout_s is not None
            keys = [offload_key(h, g) for h in wanted for g in groups]
            deadline = time.monotonic() + tier.lookup_timeout_s
            probe = state.probes[tier.name] = Probe(first, wanted, tier.store.exist(keys), deadline)
            stats.add_tier("tier_lookups", tier.name, 1)
            asked.append(probe.future)
    if asked:
        futures.wait(asked, timeout=STORE_LOOKUP_WAIT_S)
    answered = True
    for tier in stores:
        probe = state.probes[tier.name]
        if probe.found is None:
            if not probe.future.done():
                if time.monotonic() < probe.deadline:
                    answered = False
                    continue
                probe.found = []
                stats.add_tier("tier_lookup_timeouts", tier.name, 1)
            elif probe.future.exception() is not None:
                probe.found = []
                stats.add_tier("tier_lookup_errors", tier.name, 1)
            else:
                found, n = probe.future.result(), len(groups)
                probe.found = [all(found[i * n : (i + 1) * n]) for i in range(len(probe.hashes))]
            asked_at = probe.deadline - (tier.lookup_timeout_s or 0.0)
            stats.observe("lookup_wait_seconds", tier.name, time.monotonic() - asked_at)
        offset = first - probe.first
        held = probe.found[offset : offset + len(wanted)]
        state.held[tier.name] = {
            offload_key(h, g) for h, yes in zip(wanted, held, strict=False) if yes for g in groups
        }
    return answered
